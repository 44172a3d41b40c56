"""The 8-bit AdamW Triton kernel (dtrain/lowp/optim8bit/triton_step.py) on one tensor of a
model's shape, for each launch shape (256-element blocks a program x warps): ms a step and
the bytes it moves (16 a parameter) a second. One JSON line per shape. CUDA; --smoke runs
a small tensor in Triton's interpreter on the CPU (set TRITON_INTERPRET=1)."""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="14336,4096", help="rows,cols (model=8b's MLP weight)")
    ap.add_argument("--rows", default="1,2,4,8", help="blocks a program")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, a 4 x 512 tensor")
    args = ap.parse_args()
    bad = [r for r in _ints(args.rows) if r < 1 or r & (r - 1)]
    if bad:  # tl.arange takes powers of two
        ap.error(f"--rows {bad[0]}: blocks a program must be a power of two (1, 2, 4, 8, ...)")
    from torchao.optim.subclass_8bit import OptimState8bit

    from dtrain.lowp.optim8bit.triton_step import adamw8bit_step

    shape = (4, 512) if args.smoke else tuple(_ints(args.shape))
    dev = torch.device("cpu" if args.smoke else "cuda")
    iters = 1 if args.smoke else args.iters
    gen = torch.Generator(device=dev).manual_seed(0)
    p = torch.randn(shape, device=dev, generator=gen) * 0.02
    grad = torch.randn(shape, device=dev, generator=gen) * 1e-3
    moments = [OptimState8bit.zeros(shape, signed, device=dev) for signed in (True, False)]
    exp_avg, exp_avg_sq = ((s.codes, s.scale, s.qmap) for s in moments)
    step = torch.tensor(0.0)

    def run(rows: int, warps: int) -> None:
        step.add_(1)
        adamw8bit_step(
            p, grad, exp_avg, exp_avg_sq, step=step, lr=1e-4, beta1=0.9, beta2=0.95,
            weight_decay=0.1, eps=1e-8, rows=rows, num_warps=warps,
        )  # fmt: skip

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for rows, warps in itertools.product(_ints(args.rows), _ints(args.warps)):
        for _ in range(min(3, iters)):  # compiles this launch shape
            run(rows, warps)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            run(rows, warps)
        sync()
        ms = (time.perf_counter() - t0) / iters * 1e3
        row = {"shape": list(shape), "rows": rows, "warps": warps, "ms": round(ms, 4)}
        row["GB_per_s"] = round(16 * p.numel() / ms / 1e6, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
