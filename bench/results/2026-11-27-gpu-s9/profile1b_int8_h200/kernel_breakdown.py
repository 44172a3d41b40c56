"""GPU kernel time per step by kind, bf16 against int8, from the torch.profiler traces of
`PRECS="bf16 int8" bash bench/lowp.sh profile1b` (2026-11-27, 1x H200). Run in this directory:

    python kernel_breakdown.py RUN_DIR_BF16 RUN_DIR_INT8 > kernel_breakdown.md
    python kernel_breakdown.py kernel_totals.json > kernel_breakdown.md   # the same, from here

Only kernels that start inside the two traced steps' GPU windows (the `ProfilerStep#N`
gpu_user_annotation events) count. The trace also holds the tail of the step before's backward
(the CPU runs ahead of the GPU), which the profiler's own top-ops table in the .log includes:
its figures / 2 read 13-38% above these (the int8 GEMM 13%, backward kernels up to 38%). The
traces (6.4 and 8.2 MB) are not kept; kernel_totals.json holds every kernel name's calls and
microseconds per traced step.
"""

import collections
import json
import re
import sys
from pathlib import Path


def is_quantize(n):  # Inductor kernels carrying a row-wise quantize: an abs-max and a rounding
    return n.startswith("triton") and ("amax" in n or "round" in n)


KINDS = (  # first match wins
    ("int8 GEMM (Triton `_int8_mm_kernel`, dequant fused)", lambda n: n == "_int8_mm_kernel"),
    ("bf16 GEMM (cuBLAS nvjet)", lambda n: n.startswith("nvjet")),
    ("attention (cuDNN SDPA forward + backward)", lambda n: "sdpa" in n or "cudnn" in n),
    ("optimizer (fused AdamW, grad-norm)", lambda n: "multi_tensor_apply" in n or "lpnorm" in n),
    ("Inductor kernels with a quantize fused in", is_quantize),
    ("other Inductor kernels (norms, SwiGLU, RoPE, casts, loss)", lambda n: n.startswith("triton")),
    ("other eager kernels", lambda n: True),
)
# the kernels that do the same work in both runs (bf16's, int8's with a quantize fused in),
# by their names in these two traces
PAIRS = (
    ("SwiGLU backward", r"_mul_silu_silu_backward_view_4$", r"_round_silu_silu_backward_t_view_6$"),
    ("SwiGLU forward", r"^triton_poi_fused__unsafe_view_mul_silu_6$", r"_round_silu_t_view_6$"),
    ("RoPE backward", r"select_select_backward_transpose_view_7$", r"select_select_backward_t"),
    (
        "RMSNorm forward (2 a block)",
        r"^triton_red_fused__fused_rms_norm__to_copy__unsafe_view_add_\d+$",
        r"^triton_red_fused__fused_rms_norm__to_copy_(abs_add_amax\w*_view|add_view)_\d+$",
    ),
)


def load(run_dir):
    trace = next(Path(run_dir, "tensorboard", "profile").glob("rank0.*.pt.trace.json"))
    ev = json.loads(trace.read_text())["traceEvents"]
    steps = [
        e
        for e in ev
        if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("ProfilerStep")
    ]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    per_step = []
    for s in sorted(steps, key=lambda e: e["ts"]):
        names = collections.defaultdict(lambda: [0, 0.0])
        for k in kernels:
            if s["ts"] <= k["ts"] < s["ts"] + s["dur"]:
                names[k["name"]][0] += 1
                names[k["name"]][1] += k["dur"]
        per_step.append({"step": s["name"], "gpu_ms": s["dur"] / 1e3, "kernels": dict(names)})
    return {"run": Path(run_dir).name, "steps": per_step}


def per_step(run):
    """kernel name -> (calls, ms) per traced step, and the GPU window per step in ms"""
    n = len(run["steps"])
    ms, calls = collections.Counter(), collections.Counter()
    for p in run["steps"]:
        for name, (c, us) in p["kernels"].items():
            ms[name] += us / 1e3 / n
            calls[name] += c / n
    return ms, calls, sum(p["gpu_ms"] for p in run["steps"]) / n


def kind(name):
    return next(k for k, f in KINDS if f(name))


def main():
    if sys.argv[1].endswith(".json"):
        runs = json.loads(Path(sys.argv[1]).read_text())
    else:
        runs = [load(d) for d in sys.argv[1:3]]
        Path("kernel_totals.json").write_text(json.dumps(runs, indent=0))
    stats = {r["run"]: per_step(r) for r in runs}
    summary = {}
    print("| kind: ms per step (share of the step's GPU window, kernels per step) | ", end="")
    print(" | ".join(stats) + " |\n|---|" + "---|" * len(stats))
    for r, (ms, calls, step) in stats.items():
        kinds, kcalls = collections.Counter(), collections.Counter()
        for name in ms:
            kinds[kind(name)] += ms[name]
            kcalls[kind(name)] += calls[name]
        summary[r] = {"step_ms": step, "kinds_ms": kinds, "kernels_per_step": kcalls}
    for k, _ in KINDS:
        cells = []
        for r in stats:
            t, c = summary[r]["kinds_ms"][k], summary[r]["kernels_per_step"][k]
            step = summary[r]["step_ms"]
            cells.append(f"{t:.1f} ({t / step:.0%}, {c:.0f})" if t else "-")
        print(f"| {k} | " + " | ".join(cells) + " |")
    cells = []
    for r in stats:
        busy, step = sum(summary[r]["kinds_ms"].values()), summary[r]["step_ms"]
        summary[r]["idle_ms"] = step - busy
        cells.append(f"{busy:.1f} of {step:.1f} (GPU idle {step - busy:.1f})")
    print("| all kernels, of the GPU window per step | " + " | ".join(cells) + " |")

    print("\nGEMMs by name (ms per step, calls per step):\n")
    for r, (ms, calls, _) in stats.items():
        for name in sorted(ms, key=ms.get, reverse=True):
            if name.startswith("nvjet") or name == "_int8_mm_kernel":
                print(f"- {r}: {name} {ms[name]:.2f} ms ({calls[name]:.0f})")
    print("\nThe same Inductor kernel in both runs (int8's with a quantize), ms per step:\n")
    for label, *keys in PAIRS:
        cells = []
        for key, (r, (ms, calls, _)) in zip(keys, stats.items()):
            names = [n for n in ms if re.search(key, n)]
            t, c = sum(ms[n] for n in names), sum(calls[n] for n in names)
            cells.append(f"{r} {t:.2f} ({c:.0f} kernels: {', '.join(n[-40:] for n in names)})")
        print(f"- {label}: " + "; ".join(cells))
    for r, (ms, calls, _) in stats.items():
        small = [n for n in ms if is_quantize(n) and ms[n] / calls[n] < 0.030]
        big = [n for n in ms if is_quantize(n) and n not in small]
        for what, names in (("under 30 us each", small), ("30 us or more each", big)):
            t, c = sum(ms[n] for n in names), sum(calls[n] for n in names)
            print(f"- {r}: kernels with a quantize, {what}: {t:.2f} ms, {c:.0f} kernels per step")

    for r, (ms, calls, _) in stats.items():
        print(f"\n{r}: top kernels, ms per step (calls per step)\n")
        for name in sorted(ms, key=ms.get, reverse=True)[:15]:
            print(f"- {ms[name]:6.2f} ({calls[name]:.0f}) {re.sub(r'[(<].*', '', name)[:110]}")
    Path("kernel_breakdown.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
