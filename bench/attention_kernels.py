"""Causal attention forward+backward under each of trainer.attention_kernel's choices, at the
1b model's shape (micro-batch 8, 16 heads, seq 2048, head dim 128, bf16): which kernel really ran
(its CUDA kernel names, from the profiler), its time, its TFLOP/s and how far its output and
gradients are from fp32 math attention.

    python bench/attention_kernels.py --out $OUT/attention_kernels.jsonl
    python bench/attention_kernels.py --smoke     # CPU, small shape: checks that it runs

One JSON line per kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.attention import KERNELS, attention_kernel  # noqa: E402


def fwd_bwd(q, k, v, dy):
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(y, (q, k, v), dy)
    return y, dq, dk, dv


def kernels_run(fn, cuda: bool) -> list[str]:
    """Names of the device kernels `fn` launches whose names say attention."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    words = ("flash", "fmha", "cudnn", "attention", "sdpa", "softmax", "cutlass", "sm90")
    return sorted(n for n in names if any(w in n.lower() for w in words))[:8]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        args.batch, args.heads, args.seq, args.head_dim, args.iters = 1, 2, 64, 16, 2
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dy = (torch.randn(shape, device=device, generator=gen, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    # The reference: fp32 math attention (torch's pick for fp32 would be a fused kernel).
    with sdpa_kernel(SDPBackend.MATH):
        ref = fwd_bwd(*(t.detach().float().requires_grad_(True) for t in (q, k, v)), dy.float())
    # Causal: half the score matrix. Forward 2 matmuls of 2*T*T*D/2 each; backward 2.5x forward.
    flops = 3.5 * 2 * 2 * args.batch * args.heads * args.seq * args.seq * args.head_dim / 2
    lines = []
    for name in KERNELS:  # auto: torch's own pick
        with attention_kernel(name):
            try:
                out = fwd_bwd(q, k, v, dy)
            except RuntimeError as e:
                lines.append({"kernel": name, "error": str(e).splitlines()[0][:200]})
                continue
            ran = kernels_run(lambda: fwd_bwd(q, k, v, dy), cuda)  # noqa: B023 (called here)
            for _ in range(3):
                fwd_bwd(q, k, v, dy)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fwd_bwd(q, k, v, dy)
            if cuda:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / args.iters
        err = {
            n: float((a.float() - b).abs().max() / b.abs().max())
            for n, a, b in zip(("y", "dq", "dk", "dv"), out, ref)
        }
        lines.append(
            {
                "kernel": name,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "shape": list(shape),
                "ms_fwd_bwd": round(dt * 1e3, 3),
                "tflops": round(flops / dt / 1e12, 1),
                "max_rel_err_vs_fp32_math": err,
                "kernels": ran,
            }
        )
    for line in lines:
        print(json.dumps(line))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
