"""Runs the Gluon int8 GEMM (dtrain/lowp/int8/gluon_gemm.py) on this process's GPU against the
portable path (torch._int_mm, then the fp32 scales, then the cast), bit for bit, each shape,
tile and output dtype several times, and int8_mm's dispatch to it; prints each failure and exits
1 on any. A script, so tests/gpu/test_int8_kernels.py can run it under a timeout: a kernel that
deadlocked on its mbarriers would otherwise hang the suite.

    python tests/gpu/gluon_gemm_check.py
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from gluon_grouped_check import REPEATS, runs  # this directory: the script's own

from dtrain.lowp.int8 import linear as i8

# (M, N, K): edges in M and N, a K that is no multiple of the tile's (TMA's zeros past it), K
# under one step, fewer tiles than SMs (a consumer with none), one tile; then 1b's and 8b's
# forward and grad-input GEMMs (16,384 and 8,192 tokens)
SHAPES = [
    (2128, 1072, 1024),
    (1000, 520, 1040),
    (64, 64, 16),
    (130, 200, 64),
    (16384, 2048, 2048),
    (16384, 5632, 2048),
    (16384, 2048, 5632),
    (8192, 1024, 4096),
    (8192, 14336, 4096),
    (8192, 4096, 14336),
]


def operands(m, n, k, seed=0):
    """a (M, K) int8 row-major, b (K, N) int8 column-major, scales (M,) and (N,) fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g).t()
    sa = torch.rand(m, device="cuda", generator=g) + 0.01
    sb = torch.rand(n, device="cuda", generator=g) + 0.01
    return a, b, sa, sb


def main() -> int:
    from dtrain.lowp.int8 import gluon_gemm as gg  # Gluon: only where the check runs
    from dtrain.lowp.int8 import triton_gemm as it

    failures = []
    for i, (m, n, k) in enumerate(SHAPES):
        a, b, sa, sb = operands(m, n, k)
        dtypes = (torch.bfloat16, torch.float32) if i < 4 else (torch.bfloat16,)
        for dtype in dtypes:
            want = i8.scaled_int_mm(a, sa[:, None], b, sb[None, :], dtype)
            if not gg.applies(a, b, sa, sb, dtype):
                failures.append(f"{(m, n, k)} {dtype}: the kernel does not apply")
                continue
            for tile in gg.TILES:
                launch = partial(gg.launch, a, b, sa, sb, tile=tile)
                runs(f"{dtype} tile {tile}", launch, want, (m, n, k), failures)
            runs(f"{dtype} tuned", partial(gg.launch, a, b, sa, sb), want, (m, n, k), failures)
    # int8_mm's dispatch with precision.int8_gemm=gluon: scaled large problems take it (the same
    # bits), the unscaled integer product the TMA kernel
    took = []
    launch, tma = gg.launch, it._launch_int8_mm_tma
    gg.launch = lambda *a, **kw: took.append("gluon") or launch(*a, **kw)
    it._launch_int8_mm_tma = lambda *a, **kw: took.append("tma") or tma(*a, **kw)
    it.GEMM = "gluon"
    a, b, sa, sb = operands(16384, 2048, 2048)
    got = it.int8_mm(a, b, sa, sb, torch.bfloat16)
    want = i8.scaled_int_mm(a, sa[:, None], b, sb[None, :], got.dtype)
    if took != ["gluon"] or not torch.equal(got, want):
        failures.append(f"int8_mm, scaled, with GEMM=gluon: took {took}, or other bits")
    took.clear()
    if not torch.equal(it.int8_mm(a, b, None, None, torch.int32), i8.int_mm(a, b)) or took != [
        "tma"
    ]:
        failures.append(f"int8_mm, the integer product, with GEMM=gluon: took {took}")
    # GEMM=fastest: the faster kernel per shape, timed once, the same bits whichever it is
    it.GEMM = "fastest"
    for m, n, k in SHAPES[4:]:
        a, b, sa, sb = operands(m, n, k)
        want = i8.scaled_int_mm(a, sa[:, None], b, sb[None, :], torch.bfloat16)
        if not torch.equal(it.int8_mm(a, b, sa, sb, torch.bfloat16), want):
            failures.append(f"{(m, n, k)}: int8_mm with GEMM=fastest writes other bits")
    print("Gluon faster (M, K, N):", {str(k[:3]): v for k, v in it._GLUON_FASTER.items()})
    if len(it._GLUON_FASTER) != len(SHAPES) - 4:
        failures.append(f"GEMM=fastest timed {len(it._GLUON_FASTER)} shapes")
    print("tiles chosen:", gg.chosen_tiles())
    for f in failures:
        print(f)
    print(f"{len(SHAPES)} shapes x {len(gg.TILES) + 1} tiles x {REPEATS}: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
