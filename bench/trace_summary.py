"""Where a step's GPU time goes, from the torch.profiler traces a run recorded
(profile.enabled=true: <run_dir>/tensorboard/profile/rank0.*.pt.trace.json).

    python bench/trace_summary.py RUN_DIR [RUN_DIR ...] [--steps 2] [--top 8]

Prints, per run, the GPU kernel time of rank 0 per step by kind (matmuls, attention, NCCL,
Inductor's fused kernels, the optimizer, other eager kernels) and the busiest kernels, as
markdown. NCCL kernels run on their own streams, so the kinds add up to more than the step
when communication overlaps compute; `compute stream` is the busiest stream's time.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

KINDS = (  # first match wins
    ("nccl", ("nccl",)),
    ("attention", ("sdpa", "flash", "fmha")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma")),
    ("optimizer", ("adam",)),
    ("inductor (fused)", ("triton",)),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other eager")


def summarize(run_dir: Path, steps: int) -> dict:
    trace = next(Path(run_dir, "tensorboard", "profile").glob("rank0.*.pt.trace.json"))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    by_kind, by_name, by_stream = (collections.Counter() for _ in range(3))
    for e in events:
        by_kind[kind(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        by_stream[e.get("tid")] += e["dur"]
    ms = 1e-3 / steps
    return {
        "run": Path(run_dir).name,
        "compute_stream_ms": max(by_stream.values()) * ms,
        "kinds_ms": {k: v * ms for k, v in by_kind.most_common()},
        "top_ms": [(n, v * ms) for n, v in by_name.most_common()],
    }


def markdown(s: dict, top: int) -> str:
    lines = [f"**{s['run']}**: compute stream {s['compute_stream_ms']:.0f} ms per step", ""]
    lines += ["| kind | ms per step |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in s["kinds_ms"].items()]
    lines += ["", "| kernel | ms per step |", "|---|---|"]
    lines += [f"| `{n[:90]}` | {v:.1f} |" for n, v in s["top_ms"][:top]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=2, help="steps in the trace (profile.active)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per run")
    args = ap.parse_args()
    for d in args.run_dirs:
        print(markdown(summarize(d, args.steps), args.top))


if __name__ == "__main__":
    main()
