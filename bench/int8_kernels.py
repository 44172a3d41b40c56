"""int8 kernels on one GPU: bf16 against torch._int_mm against dtrain's Triton kernels,
per matmul and end to end, every ratio against the bf16 measured in the same run of the script.

    python bench/int8_kernels.py --out $OUT            # ~5 min on one H100: both parts
    python bench/int8_kernels.py --out $OUT --part micro   # the matmuls and quantizes only
    python bench/int8_kernels.py --out $OUT --part micro --gate-only  # the SwiGLU gate only
    python bench/int8_kernels.py --out $OUT --part micro --quantize-only  # the quantizes only
    python bench/int8_kernels.py --out $OUT --part e2e     # the three training runs only
    python bench/int8_kernels.py --smoke --out /tmp/x  # tiny, on CPU (a test runs it)

1. Matmuls (its own process): for each linear of model=1b (16384 tokens: micro-batch 8 x seq
   2048) and model=8b (8192 tokens: seq 8192), the forward, grad-input and grad-weight GEMM
   shapes, timed with triton.testing.do_bench (L2 flushed between runs):
     bf16        torch.mm in the operand layouts autograd uses for an nn.Linear
     _int_mm     torch._int_mm + the eager dequantizing multiply (int8.scaled_int_mm)
     triton      dtrain's Triton int8 GEMM, dequantization fused, bf16 out (autotuned first)
     triton TMA  its persistent TMA kernel; for grad-input also with an fp32 output, what
                 q, k, v, w1 and w3 wrote for their fp32 inputs before bf16 won
     Gluon       on Hopper, the warp-specialized Gluon GEMM (precision.int8_gemm=gluon), bf16
                 out, its tile tuned first; the table marks a result that is not the TMA
                 kernel's bits
     grouped     for grad-weight, precision.int8_grad_weight=int8_grouped's GEMM (scales per
                 row per 128 tokens, fp32 out): the Triton kernels, and on Hopper the Gluon one
                 (precision.int8_grouped_gemm=gluon), its faster tile
   and one int8 linear's forward + backward, eagerly, per 1b layer shape (bf16 F.linear,
   int8 on torch._int_mm, int8 on Triton); and the row-wise quantize of activations,
   gradients, weights and transposed weights: eager, torch.compile'd, the Triton op
   (autotuned), and its two ways, one pass and two sweeps, each with a fixed tile; and
   the SwiGLU gate of each model's FFN with its quantizes (precision.int8_swiglu), forward and
   backward: bf16 alone (eager, compiled), compiled with the quantizes (what Inductor fuses
   for the three Int8Linear layers) and dtrain's Triton kernels, one pass and two sweeps.
2. End to end: launch/train.py with model=1b, one GPU, seq 2048, micro-batch 8, synthetic
   tokens, 40 steps (bench/common.sh's settings; tokens/s is the median of the 10-step
   intervals after the first, which holds compilation): precision=bf16, precision=int8 with
   precision.int8_kernel=triton, and with precision.int8_kernel=torch; tokens/s, MFU, peak reserved
   and allocated memory (bench/dtrain_result.py).

Writes OUT/int8_kernels.json (everything, with the device, versions and the configs autotuning
chose), OUT/int8_kernels.md (the tables) and OUT/e2e_<run>.log. A part that fails is recorded
as an error and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Linear layers of a transformer block: name -> (out_features, in_features); d, kv, ffn from
# conf/model/{1b,8b}.yaml (8b: 8 kv heads of 128 -> k, v are 4096 -> 1024).
MODELS = {
    "1b": {
        "tokens": 16384,
        "linears": {"q,o": (2048, 2048), "w1,w3": (5632, 2048), "w2": (2048, 5632)},
    },
    "8b": {
        "tokens": 8192,
        "linears": {
            "q,o": (4096, 4096),
            "k,v": (1024, 4096),
            "w1,w3": (14336, 4096),
            "w2": (4096, 14336),
        },
    },
}
SMOKE_MODELS = {"tiny": {"tokens": 128, "linears": {"w1": (96, 64), "w2": (64, 96)}}}
# bench/common.sh's shared overrides, for model=1b on one GPU
E2E_COMMON = [
    "model=1b",
    "data=synthetic",
    "trainer.seq_len=2048",
    "trainer.micro_batch_size=8",
    "trainer.eval_every=0",
    "checkpoint.save_final=false",
    "trainer.progress_bar=false",
    "optim.warmup_steps=10",
]
SMOKE_COMMON = [
    "model=tiny",
    "data=synthetic",
    "trainer.seq_len=64",
    "trainer.micro_batch_size=2",
    "trainer.eval_every=0",
    "checkpoint.save_final=false",
    "trainer.progress_bar=false",
    "optim.warmup_steps=1",
    "trainer.device=cpu",
]
# name -> (precision, precision.int8_kernel, more overrides)
E2E_RUNS = {
    "bf16": ("bf16", "", []),
    "int8_triton": ("int8", "triton", []),
    # all three matmuls int8 (grad-weight too): the Triton GEMM's gain on the third matmul
    "int8_triton_gw8": ("int8", "triton", ["precision.int8_grad_weight=int8"]),
    "int8_torch": ("int8", "torch", []),
    "fp8": ("fp8", "", []),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- part 1: matmuls and quantizes ------------------------------------------------------------


def _timer(device):
    """ms per call: triton's do_bench on CUDA (median, L2 flushed), a plain loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=50)

    def cpu_time(fn, n=3):
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    return cpu_time


def _try(fn, *args, **kwargs):
    """fn(*args, **kwargs), or {"error": ...}: a benchmark records failures and goes on."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"
        log(f"  error: {msg}")
        return {"error": msg}


def _first_then_time(ms, fn):
    fn()  # the first call compiles (and for the Triton GEMM autotunes): not timed
    return ms(fn)


def gemm_cases(models: dict) -> list[dict]:
    """One case per (model, linear, role): the GEMM's (M, N, K) = (rows, cols, reduction)."""
    cases = []
    for model, spec in models.items():
        t = spec["tokens"]
        for name, (n_out, n_in) in spec["linears"].items():
            cases += [
                {"model": model, "linear": name, "role": "forward", "mnk": (t, n_out, n_in)},
                {"model": model, "linear": name, "role": "grad_input", "mnk": (t, n_in, n_out)},
                {"model": model, "linear": name, "role": "grad_weight", "mnk": (n_out, n_in, t)},
            ]
    return cases


def _bf16_operands(role, m, n, k, device):
    """The bf16 matmul an nn.Linear's autograd runs for `role`, as a closure."""
    import torch

    bf = {"dtype": torch.bfloat16, "device": device}
    if role == "forward":  # y = x W^T: x (M, K), W (N, K)
        x, w = torch.randn(m, k, **bf), torch.randn(n, k, **bf)
        return lambda: torch.mm(x, w.t())
    if role == "grad_input":  # dx = dy W: dy (M, K=out), W (out, N=in)
        dy, w = torch.randn(m, k, **bf), torch.randn(k, n, **bf)
        return lambda: torch.mm(dy, w)
    dy, x = torch.randn(k, m, **bf), torch.randn(k, n, **bf)  # dW = dy^T x over K tokens
    return lambda: torch.mm(dy.t(), x)


def _fp8_mm(a, b, sa, sb):
    """torch._scaled_mm on e4m3 copies of the int8 operands (made once, cached on `a`)."""
    import torch

    if not hasattr(a, "_fp8"):
        a._fp8 = (a.to(torch.float8_e4m3fn), b.t().to(torch.float8_e4m3fn).t())
    fa, fb = a._fp8
    return torch._scaled_mm(fa, fb, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


# bf16 first: the others' speed-ups are against it. "grouped" (the Triton kernels) and
# "grouped_gluon" (dtrain/lowp/int8/grouped_gluon.py, Hopper only; the faster of its tiles,
# named in the JSON's `grouped_gluon_tile`): grad-weight GEMMs only.
GEMM_WAYS = (
    "bf16", "int_mm_dequant", "triton", "triton_tma", "triton_tma_f32", "gluon", "grouped",
    "grouped_gluon", "fp8",
)  # fmt: skip


def bench_gemms(cases, device, with_triton: bool) -> list[dict]:
    import torch

    from dtrain.lowp.int8 import linear as i8

    ms = _timer(device)
    seen: dict[tuple, dict] = {}
    out = []
    for case in cases:
        m, n, k = case["mnk"]
        key = (case["role"], m, n, k)
        if key not in seen:
            log(f"gemm {case['model']} {case['linear']} {case['role']} M={m} N={n} K={k}")
            a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device)
            b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device).t()
            sa = torch.rand(m, 1, device=device) + 0.01
            sb = torch.rand(1, n, device=device) + 0.01
            bf16_mm = _try(_bf16_operands, case["role"], m, n, k, device)
            res = {
                "bf16_ms": _try(_first_then_time, ms, bf16_mm),
                "int_mm_ms": _try(_first_then_time, ms, partial(i8.int_mm, a, b)),
                "int_mm_dequant_ms": _try(
                    _first_then_time, ms, partial(i8.scaled_int_mm, a, sa, b, sb, torch.bfloat16)
                ),
            }
            if with_triton:
                from dtrain.lowp.int8 import triton_gemm as it

                tri = partial(it.int8_mm, a, b, sa, sb, torch.bfloat16)
                res["triton_ms"] = _try(_first_then_time, ms, tri)
                if it.tma_ok(a, b):  # the persistent TMA kernel (precision.int8_gemm=tma)
                    c = torch.empty(m, n, dtype=torch.bfloat16, device=device)
                    sa1, sb1 = sa.reshape(-1), sb.reshape(-1).contiguous()
                    tma = partial(it._launch_int8_mm_tma, a, b, c, sa1, sb1)
                    res["triton_tma_ms"] = _try(_first_then_time, ms, tma)
                    res.update(_gluon_gemm(ms, a, b, sa1, sb1, c))
                    if case["role"] == "grad_input":  # q, k, v, w1, w3 take fp32 inputs:
                        # their grad-input GEMM wrote fp32 before bf16 won
                        c32 = torch.empty(m, n, dtype=torch.float32, device=device)
                        tma32 = partial(it._launch_int8_mm_tma, a, b, c32, sa1, sb1)
                        res["triton_tma_f32_ms"] = _try(_first_then_time, ms, tma32)
                if case["role"] == "grad_weight":  # precision.int8_grad_weight=int8_grouped:
                    # a scale per row per 128 tokens of the reduction, fp32 out (the weight's)
                    from dtrain.lowp.int8 import grouped_triton as igt

                    sg = torch.rand(m, igt.group_count(k), device=device) + 0.01
                    grouped = partial(igt.int8_mm_grouped, a, b, sg, torch.float32)
                    with igt.grouped_gemm("triton"):  # the Gluon kernel: its own column
                        res["grouped_ms"] = _try(_first_then_time, ms, grouped)
                    res.update(_gluon_grouped(ms, a, b, sg, device))
                # cuBLAS with 8-bit operands, row-wise scales, bf16 out: what fp8 gets
                res["fp8_ms"] = _try(_first_then_time, ms, partial(_fp8_mm, a, b, sa, sb))
            del a, b, bf16_mm
            seen[key] = res
        res = dict(seen[key])
        flop = 2 * m * n * k
        for v in GEMM_WAYS:
            t = res.get(f"{v}_ms")
            if isinstance(t, float):
                res[f"{v}_tflops"] = flop / t / 1e9
        for v in GEMM_WAYS[1:]:
            if isinstance(res.get(f"{v}_ms"), float) and isinstance(res.get("bf16_ms"), float):
                res[f"{v}_speedup_vs_bf16"] = res["bf16_ms"] / res[f"{v}_ms"]
        out.append({**case, **res})
    return out


def _gluon_gemm(ms, a, b, sa, sb, tma_out) -> dict:
    """The warp-specialized Gluon GEMM (precision.int8_gemm=gluon), its tile tuned on the first
    call, where it applies (Hopper): its time, the tile, and whether it wrote the TMA kernel's
    bits (`tma_out`, just computed); {} elsewhere."""
    import torch

    from dtrain.lowp.int8.gluon_support import has_gluon_hopper

    if not has_gluon_hopper():
        return {}
    from dtrain.lowp.int8 import gluon_gemm as gg

    if not gg.applies(a, b, sa, sb, tma_out.dtype):
        return {}
    out = torch.empty_like(tma_out)
    res = {"gluon_ms": _try(_first_then_time, ms, partial(gg.launch, a, b, sa, sb, out))}
    if isinstance(res["gluon_ms"], float):
        res["gluon_tile"] = list(gg._tuned(a, b, sa, sb, out))
        res["gluon_equals_tma"] = torch.equal(out, tma_out)
    return res


def _gluon_grouped(ms, a, b, sg, device) -> dict:
    """The Gluon grouped GEMM at each of its tiles (Hopper, operands TMA reads): the fastest's
    time and which tile it was; {} where it cannot run."""
    import torch

    from dtrain.lowp.int8 import grouped_triton as igt
    from dtrain.lowp.int8.gluon_support import has_gluon_hopper

    if not (has_gluon_hopper() and igt.gluon_applies(a, b)):  # the dispatch's own test
        return {}
    from dtrain.lowp.int8 import grouped_gluon as gg

    out = torch.empty(a.shape[0], b.shape[1], device=device)
    times = {t: _try(_first_then_time, ms, partial(gg.launch, a, b, sg, out, t)) for t in gg.TILES}
    timed = {t: v for t, v in times.items() if isinstance(v, float)}
    if not timed:
        return {"grouped_gluon_ms": next(iter(times.values()))}  # the error
    best = min(timed, key=timed.get)
    every = {"x".join(map(str, t)): v for t, v in times.items()}  # BLOCK_M x BLOCK_N x stages
    return {"grouped_gluon_ms": timed[best], "grouped_gluon_tile": list(best),
            "grouped_gluon_tiles_ms": every}  # fmt: skip


def _fwd_bwd(linear, x, w, dy):
    import torch

    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = linear(x, w)
    y.backward(dy)


def bench_linears(models, device, with_triton: bool) -> list[dict]:
    """One linear layer's forward + backward, eagerly, under bf16 autocast."""
    import torch
    import torch.nn.functional as F

    from dtrain.lowp.int8 import linear as i8

    ms = _timer(device)
    model = next(iter(models))
    t = models[model]["tokens"]
    out = []
    for name, (n_out, n_in) in models[model]["linears"].items():
        log(f"linear {model} {name}: fwd+bwd, {t} tokens, {n_in} -> {n_out}")
        x = torch.randn(t, n_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n_out, n_in, device=device) * 0.02).requires_grad_()  # fp32 master
        dy = torch.randn(t, n_out, device=device, dtype=torch.bfloat16)

        variants = {
            "bf16": F.linear,
            "int8_torch": partial(i8.int8_linear, grad_weight="bf16", kernel="torch"),
        }
        if with_triton:
            variants["int8_triton"] = partial(i8.int8_linear, grad_weight="bf16", kernel="triton")
        res = {"model": model, "linear": name, "tokens": t, "in": n_in, "out": n_out}
        for v, fn in variants.items():
            res[f"{v}_ms"] = _try(_first_then_time, ms, partial(_fwd_bwd, fn, x, w, dy))
        for v in ("int8_torch", "int8_triton"):
            if isinstance(res.get(f"{v}_ms"), float) and isinstance(res.get("bf16_ms"), float):
                res[f"{v}_speedup_vs_bf16"] = res["bf16_ms"] / res[f"{v}_ms"]
        out.append(res)
    return out


# The quantize's timings: eager, torch.compile'd, the Triton op (autotuned), its two ways.
QUANTIZE_WAYS = ("eager", "compiled", "triton", "triton_one_pass", "triton_two_sweeps")
# int8_grouped's quantize of an output gradient (bf16 activations' shapes): per column per 128
# rows, codes written transposed; Inductor's fusion of the torch ops, and the Triton op.
GROUPED_QUANTIZE_WAYS = ("grouped_compiled", "grouped_triton")


def bench_quantize(models, device, with_triton: bool) -> list[dict]:
    import torch

    from dtrain.lowp.int8 import grouped as ig
    from dtrain.lowp.int8 import linear as i8

    torch._dynamo.config.cache_size_limit = 64  # a compile per shape and layout
    ms = _timer(device)
    compiled = torch.compile(i8.quantize_rowwise, dynamic=False)
    grouped = torch.compile(ig.quantize_groups, dynamic=False)
    cases = []
    for model, spec in models.items():
        t = spec["tokens"]
        n_out, n_in = max(spec["linears"].values(), key=lambda v: v[0] * v[1])
        cases += [
            (model, "activation x (bf16)", (t, n_in), torch.bfloat16, False),
            (model, "activation x (bf16), wide", (t, n_out), torch.bfloat16, False),
            (model, "weight W (fp32)", (n_out, n_in), torch.float32, False),
            (model, "weight W^T (fp32, transposed view)", (n_in, n_out), torch.float32, True),
        ]
    out = []
    for model, what, (r, c), dtype, transposed in cases:
        log(f"quantize {model} {what} {r}x{c}")
        x = (
            torch.randn(c, r, device=device, dtype=dtype).t()
            if transposed
            else torch.randn(r, c, device=device, dtype=dtype)
        )
        res = {"model": model, "tensor": what, "shape": [r, c]}
        res["eager_ms"] = _try(_first_then_time, ms, partial(i8.quantize_rowwise, x))
        res["compiled_ms"] = _try(_first_then_time, ms, partial(compiled, x))
        if with_triton:
            from dtrain.lowp.int8 import triton_gemm as it

            res["triton_ms"] = _try(_first_then_time, ms, partial(it.quantize_rowwise, x, None))
            # each way with its fixed tile (the op autotunes contiguous rows among both; rows
            # strided in memory always take the sweeps, whose tile loads them coalesced)
            if c <= it.ONE_PASS_MAX and not transposed:  # a power of two: as prune_row_tiles
                one = partial(it.quantize_rows, x, None, one_pass=True)
                res["triton_one_pass_ms"] = _try(_first_then_time, ms, one)
            two = partial(it.quantize_rows, x, None, one_pass=False)
            res["triton_two_sweeps_ms"] = _try(_first_then_time, ms, two)
        if dtype == torch.bfloat16 and not transposed:  # an output gradient's shape
            ts = torch.rand(r, 1, device=device) + 0.01
            res["grouped_compiled_ms"] = _try(_first_then_time, ms, partial(grouped, x, ts))
            if with_triton:
                from dtrain.lowp.int8 import grouped_triton as igt

                tri = partial(igt.quantize_groups, x, ts)
                res["grouped_triton_ms"] = _try(_first_then_time, ms, tri)
        nbytes = r * c * (x.element_size() + 1) + r * 4  # read x, write q and the scales
        for v in QUANTIZE_WAYS + GROUPED_QUANTIZE_WAYS:
            if isinstance(res.get(f"{v}_ms"), float):
                res[f"{v}_gb_per_s"] = nbytes / res[f"{v}_ms"] / 1e6
        out.append(res)
    return out


def bench_gate(models, device, with_triton: bool) -> list[dict]:
    """Each model's SwiGLU gate, forward (silu(a) * b, then w2's input quantize) and backward
    (autograd's gradients of a and b, then their quantizes), ms per call on bf16 (M, F)."""
    import torch
    import torch.nn.functional as F

    from dtrain.lowp.int8 import linear as i8

    torch._dynamo.config.cache_size_limit = 64
    ms = _timer(device)

    def fw(a, b):
        return F.silu(a) * b

    def bw(dh, a, b):  # autograd's: the product's backward, then silu's
        return torch.ops.aten.silu_backward(dh * b, a), dh * F.silu(a)

    def fw_q(a, b):
        return i8.quantize_rowwise(fw(a, b))

    def bw_q(dh, a, b):  # and w2's input recomputed, as the compiled linears and the kernel do
        ga, gb = bw(dh, a, b)
        return ga, gb, i8.quantize_rowwise(ga), i8.quantize_rowwise(gb), fw_q(a, b)

    def compiled(fn):
        return torch.compile(fn, dynamic=False)

    variants = {
        "forward": {
            "bf16_eager": fw,
            "bf16_compiled": compiled(fw),
            "quant_compiled": compiled(fw_q),
        },
        "backward": {
            "bf16_eager": bw,
            "bf16_compiled": compiled(bw),
            "quant_compiled": compiled(bw_q),
        },
    }
    if with_triton:
        from dtrain.lowp.experimental import int8_swiglu_triton as swt

        for one_pass, name in (
            (None, "triton_tuned"),
            (True, "triton_one_pass"),
            (False, "triton_two_sweeps"),
        ):
            variants["forward"][name] = partial(swt.gate_quantize, one_pass=one_pass)
            variants["backward"][name] = partial(swt.gate_backward_quantize, one_pass=one_pass)
    out = []
    for model, spec in models.items():
        lin = spec["linears"]
        m, f = spec["tokens"], lin.get("w1,w3", lin.get("w1"))[0]
        g = torch.Generator(device=device).manual_seed(0)
        a, b, dh = (
            (s * torch.randn(m, f, device=device, generator=g)).bfloat16() for s in (3.0, 1.0, 0.1)
        )
        for direction, fns in variants.items():
            log(f"gate {model} {direction} {m}x{f}")
            args = (a, b) if direction == "forward" else (dh, a, b)
            res = {"model": model, "pass": direction, "shape": [m, f]}
            for name, fn in fns.items():
                res[f"{name}_ms"] = _try(_first_then_time, ms, partial(fn, *args))
            out.append(res)
        del a, b, dh
    return out


def part_micro(args) -> dict:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    models = SMOKE_MODELS if args.smoke else MODELS
    with_triton = device.type == "cuda"
    info = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        import triton

        from dtrain.lowp.int8 import linear as i8

        info.update(
            name=torch.cuda.get_device_name(),
            capability=list(torch.cuda.get_device_capability()),
            cuda=torch.version.cuda,
            triton=triton.__version__,
            dispatch=list(i8.select_kernel(device)),
        )
    log(f"micro: {info}")
    res = {"info": info}
    if args.gate_only:
        res["gate"] = bench_gate(models, device, with_triton)
    elif args.quantize_only:
        res["quantize"] = bench_quantize(models, device, with_triton)
    else:
        res["gemms"] = bench_gemms(gemm_cases(models), device, with_triton)
        if not args.gemms_only:
            res["linears"] = bench_linears(models, device, with_triton)
            res["quantize"] = bench_quantize(models, device, with_triton)
            res["gate"] = bench_gate(models, device, with_triton)
    if with_triton:
        from dtrain.lowp.experimental import int8_swiglu_triton as swt
        from dtrain.lowp.int8 import grouped_triton as igt
        from dtrain.lowp.int8 import triton_gemm as it

        res["autotuned"] = {
            **it.tuned_configs(),
            **igt.tuned_configs(),
            **{f"gate {k}": v for k, v in swt.tuned_configs().items()},
        }
    return res


# --- part 2: end to end -----------------------------------------------------------------------


def run_e2e(name: str, args, out_dir: Path) -> dict:
    precision, kernel, extra = E2E_RUNS[name]
    steps = 4 if args.smoke else args.e2e_steps
    run_dir = Path(args.run_root) / f"int8k_{name}"
    cmd = [
        sys.executable,
        "launch/train.py",
        *(SMOKE_COMMON if args.smoke else E2E_COMMON),
        f"trainer.max_steps={steps}",
        f"trainer.log_every={2 if args.smoke else 10}",
        f"precision={precision}",
        *([f"precision.int8_kernel={kernel}"] if kernel else []),
        *extra,
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    log(f"e2e {name}: precision={precision} precision.int8_kernel={kernel or '(default)'}")
    t0 = time.perf_counter()
    log_path = out_dir / f"e2e_{name}.log"
    with open(log_path, "w") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.e2e_timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log_path.read_text(errors="replace")
    res = {
        "run": name,
        "precision": precision,
        "int8_kernel": kernel or None,
        "command": " ".join(cmd[1:]),
        "returncode": rc,
        "wall_s": round(time.perf_counter() - t0, 1),
        "int8_line": next(iter(re.findall(r"int8 matmuls: .*", text)), None),
    }
    if rc != 0:
        res["error"] = text.strip().splitlines()[-1][:300] if text.strip() else "no output"
        log(f"  failed ({rc}): {res['error']}")
        return res
    sys.path.insert(0, str(ROOT / "bench"))
    from dtrain_result import summarize

    s = summarize(run_dir)
    mem = s["memory_per_rank"][0]
    res.update(
        tokens_per_s=s["tokens_per_s"],
        mfu=s["mfu"],
        intervals=s["intervals"],
        peak_reserved_gib=mem["peak_reserved_gib"],
        peak_allocated_gib=mem["peak_allocated_gib"],
        final_loss=s["final_loss"],
    )
    log(f"  {res['tokens_per_s']:.0f} tok/s, peak reserved {mem['peak_reserved_gib']:.2f} GiB")
    return res


def part_e2e(args, out_dir: Path) -> list[dict]:
    runs = [run_e2e(name, args, out_dir) for name in args.e2e_runs.split(",")]
    base = next((r for r in runs if r["run"] == "bf16" and "tokens_per_s" in r), None)
    for r in runs:
        if base and "tokens_per_s" in r:
            r["speed_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
            if base["peak_reserved_gib"]:  # 0 on CPU
                r["reserved_vs_bf16"] = r["peak_reserved_gib"] / base["peak_reserved_gib"]
    return runs


# --- tables -----------------------------------------------------------------------------------


def _f(v, fmt="{:.3f}"):
    if isinstance(v, (int, float)):
        return fmt.format(v)
    return "error" if isinstance(v, dict) else "-"


def _cell(ms, rate) -> str:
    """'ms (rate)', 'error' or '-'."""
    return f"{ms:.3f} ({rate:.0f})" if isinstance(ms, float) else _f(ms)


def _ratio(base, new):
    """base / new where both are times, else None."""
    return base / new if isinstance(base, float) and isinstance(new, float) else None


def _same(g: dict) -> str:
    """The Gluon cell's mark: ' (bits differ from TMA's)' where they do."""
    return " (bits differ from TMA's)" if g.get("gluon_equals_tma") is False else ""


def render(res: dict) -> str:
    lines = ["# int8 kernels (bench/int8_kernels.py)", ""]
    info = res.get("micro", {}).get("info", {})
    if info:
        lines += [
            f"Device: {info.get('name', info.get('device'))}; torch {info.get('torch')}; "
            f"triton {info.get('triton', '-')}; dispatch: {info.get('dispatch')}",
            "",
        ]
    gemms = res.get("micro", {}).get("gemms", [])
    if gemms:
        lines += [
            "## GEMMs (ms; TFLOP/s or TOP/s; speed-up against bf16 torch.mm)",
            "",
            "| model | linear | role | M N K | bf16 | _int_mm + dequant | triton (fused) "
            "| triton TMA | TMA, fp32 out | Gluon (warp-specialized) | grouped (grad-weight, fp32 "
            "out) | grouped, Gluon | fp8 _scaled_mm | _int_mm vs bf16 | triton vs bf16 "
            "| TMA vs bf16 | Gluon vs TMA | grouped vs bf16 | grouped Gluon vs bf16 "
            "| fp8 vs bf16 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for g in gemms:
            lines.append(
                f"| {g['model']} | {g['linear']} | {g['role']} | {' '.join(map(str, g['mnk']))} "
                f"| {_cell(g.get('bf16_ms'), g.get('bf16_tflops'))} "
                f"| {_cell(g.get('int_mm_dequant_ms'), g.get('int_mm_dequant_tflops'))} "
                f"| {_cell(g.get('triton_ms'), g.get('triton_tflops'))} "
                f"| {_cell(g.get('triton_tma_ms'), g.get('triton_tma_tflops'))} "
                f"| {_cell(g.get('triton_tma_f32_ms'), g.get('triton_tma_f32_tflops'))} "
                f"| {_cell(g.get('gluon_ms'), g.get('gluon_tflops'))}{_same(g)} "
                f"| {_cell(g.get('grouped_ms'), g.get('grouped_tflops'))} "
                f"| {_cell(g.get('grouped_gluon_ms'), g.get('grouped_gluon_tflops'))} "
                f"| {_cell(g.get('fp8_ms'), g.get('fp8_tflops'))} "
                f"| {_f(g.get('int_mm_dequant_speedup_vs_bf16'), '{:.2f}x')} "
                f"| {_f(g.get('triton_speedup_vs_bf16'), '{:.2f}x')} "
                f"| {_f(g.get('triton_tma_speedup_vs_bf16'), '{:.2f}x')} "
                f"| {_f(_ratio(g.get('triton_tma_ms'), g.get('gluon_ms')), '{:.2f}x')} "
                f"| {_f(g.get('grouped_speedup_vs_bf16'), '{:.2f}x')} "
                f"| {_f(g.get('grouped_gluon_speedup_vs_bf16'), '{:.2f}x')} "
                f"| {_f(g.get('fp8_speedup_vs_bf16'), '{:.2f}x')} |"
            )
        lines.append("")
    lins = res.get("micro", {}).get("linears", [])
    if lins:
        lines += [
            "## One linear, forward + backward, eager (ms; SwitchBack grad-weight in bf16)",
            "",
            "| model | linear | tokens x in -> out | bf16 | int8 torch._int_mm | int8 triton "
            "| torch vs bf16 | triton vs bf16 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in lins:
            lines.append(
                f"| {r['model']} | {r['linear']} | {r['tokens']} x {r['in']} -> {r['out']} "
                f"| {_f(r.get('bf16_ms'))} | {_f(r.get('int8_torch_ms'))} "
                f"| {_f(r.get('int8_triton_ms'))} "
                f"| {_f(r.get('int8_torch_speedup_vs_bf16'), '{:.2f}x')} "
                f"| {_f(r.get('int8_triton_speedup_vs_bf16'), '{:.2f}x')} |"
            )
        lines.append("")
    quant = res.get("micro", {}).get("quantize", [])
    if quant:
        lines += [
            "## Row-wise quantize (ms; GB/s of x read + q and scales written)",
            "",
            "Triton: the op (contiguous rows autotuned, the tile chosen is in the JSON's "
            "`autotuned`), and each way's fixed tile.",
            "",
            "| model | tensor | R x C | eager | torch.compile | triton | triton, one pass "
            "| triton, two sweeps | per 128 rows (int8_grouped), compiled | the same, triton |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for q in quant:
            ways = QUANTIZE_WAYS + GROUPED_QUANTIZE_WAYS
            lines.append(
                f"| {q['model']} | {q['tensor']} | {q['shape'][0]} x {q['shape'][1]} "
                + "".join(f"| {_cell(q.get(f'{v}_ms'), q.get(f'{v}_gb_per_s'))} " for v in ways)
                + "|"
            )
        lines.append("")
    gate = res.get("micro", {}).get("gate", [])
    if gate:
        names = ("bf16_eager", "bf16_compiled", "quant_compiled", "triton_tuned")
        names += ("triton_one_pass", "triton_two_sweeps")
        lines += [
            "## SwiGLU gate with its quantizes (ms per call, bf16 (M, F))",
            "",
            "Triton: autotuned (the ops training calls; the tile chosen is in the JSON's "
            "`autotuned`), and each way's fixed tile (one pass forced on 8b's row: autotuning "
            "never offers it there, past ONE_PASS_MAX, where the backward spills registers).",
            "",
            "| model | pass | M x F | bf16 eager | bf16 compiled | + quantizes, compiled "
            "| triton, tuned | triton, one pass | triton, two sweeps |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in gate:
            lines.append(
                f"| {r['model']} | {r['pass']} | {r['shape'][0]} x {r['shape'][1]} "
                + "".join(f"| {_f(r.get(f'{n}_ms'))} " for n in names)
                + "|"
            )
        lines.append("")
    e2e = res.get("e2e", [])
    if e2e:
        lines += [
            "## End to end: model=1b, 1 GPU, seq 2048, micro-batch 8, synthetic tokens",
            "",
            "| run | tokens/s | vs bf16 | MFU | peak reserved GiB | vs bf16 | peak allocated GiB "
            "| int8 path logged |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in e2e:
            if "tokens_per_s" not in r:
                lines.append(f"| {r['run']} | failed: {r.get('error')} | | | | | | |")
                continue
            lines.append(
                f"| {r['run']} | {r['tokens_per_s']:,.0f} "
                f"| {_f(r.get('speed_vs_bf16'), '{:.3f}x')} "
                f"| {_f(r.get('mfu'), '{:.1%}')} | {r['peak_reserved_gib']:.2f} "
                f"| {_f(r.get('reserved_vs_bf16'), '{:.3f}x')} | {r['peak_allocated_gib']:.2f} "
                f"| {r.get('int8_line') or ''} |"
            )
        lines.append("")
    return "\n".join(lines)


def _write(out_dir: Path, res: dict) -> None:
    """After every part: a call cut short still leaves what it measured."""
    tmp = out_dir / "int8_kernels.json.tmp"
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(out_dir / "int8_kernels.json")
    (out_dir / "int8_kernels.md").write_text(render(res))


def _str_keys(obj):
    """JSON keys must be strings: autotuning's cache is keyed by shape tuples."""
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_str_keys(v) for v in obj]
    return obj


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    p.add_argument("--part", choices=["all", "micro", "e2e"], default="all")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and model, on CPU")
    p.add_argument("--gemms-only", action="store_true", help="micro: the GEMMs alone")
    p.add_argument("--gate-only", action="store_true", help="micro: the SwiGLU gate alone")
    p.add_argument("--quantize-only", action="store_true", help="micro: the quantizes alone")
    p.add_argument("--e2e-steps", type=int, default=40)
    p.add_argument("--e2e-runs", default=",".join(E2E_RUNS))
    p.add_argument("--e2e-timeout", type=int, default=300, help="seconds per training run")
    p.add_argument("--run-root", default="/tmp/runs")
    p.add_argument("--micro-json", type=Path, help=argparse.SUPPRESS)  # the micro child's output
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    if args.micro_json:  # the child process of part 1
        args.micro_json.write_text(json.dumps(_str_keys(part_micro(args)), default=str))
        return

    res: dict = {"argv": sys.argv[1:]}
    if args.part in ("all", "micro"):
        # In its own process: the training runs that follow get a GPU with nothing else on it.
        child = args.out / "micro.json"
        cmd = [sys.executable, __file__, "--out", str(args.out), "--micro-json", str(child)]
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--gemms-only"] if args.gemms_only else []
        cmd += ["--gate-only"] if args.gate_only else []
        cmd += ["--quantize-only"] if args.quantize_only else []
        log("part 1: matmuls and quantizes")
        rc = subprocess.run(cmd, cwd=ROOT, timeout=900).returncode
        if rc == 0 and child.exists():
            res["micro"] = json.loads(child.read_text())
            child.unlink()
        else:
            res["micro"] = {"error": f"the micro benchmark exited with {rc}"}
        _write(args.out, res)
    if args.part in ("all", "e2e"):
        log("part 2: end to end")
        res["e2e"] = part_e2e(args, args.out)
        _write(args.out, res)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    _write(args.out, res)
    print(render(res), flush=True)
    log(f"done in {res['wall_s']:.0f} s: {args.out / 'int8_kernels.json'}")


if __name__ == "__main__":
    main()
