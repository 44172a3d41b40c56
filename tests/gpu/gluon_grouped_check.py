"""Runs the Gluon grouped GEMM (dtrain/lowp/int8/grouped_gluon.py) on this process's GPU against
the portable path, bit for bit, each shape and tile several times; prints each failure and
exits 1 on any. A script, so tests/gpu/test_int8_kernels.py can run it under a timeout: a kernel
that deadlocked on its mbarriers would otherwise hang the suite, with no Python left to stop it.

    python tests/gpu/gluon_grouped_check.py
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from dtrain.lowp.int8 import grouped as ig

# (N, M, K) of out (N, K) = gq (N, M) @ xq (M, K): edges everywhere, 1b's grad-weights, one
# group, less than one (M, the reduction, a multiple of 16: rows TMA reads)
SHAPES = [
    (1072, 2128, 560),
    (5632, 16384, 2048),
    (2048, 16384, 5632),
    (256, 128, 16),
    (256, 64, 16),
]
REPEATS = 3  # a race that passes once by luck


def operands(n, m, k, seed=0):
    """a (N, M) int8 row-major, b (M, K) int8 column-major, scales (N, groups) laid out as
    quantize_groups lays them out (a group's contiguous)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-127, 128, (n, m), dtype=torch.int8, device="cuda", generator=g)
    b = torch.randint(-127, 128, (k, m), dtype=torch.int8, device="cuda", generator=g).t()
    s = torch.rand(ig.group_count(m), n, device="cuda", generator=g).t() + 0.01  # quantize_groups'
    return a, b, s


def runs(label, launch, want, shape, failures) -> None:
    """launch(out) REPEATS times into NaN-filled outputs of want's dtype (unwritten stays NaN),
    each bit for bit `want`. Names the launch first: a run that hangs shows which. (Also
    tests/gpu/gluon_gemm_check.py's.)"""
    print(f"{shape} {label}", flush=True)
    for r in range(REPEATS):
        out = torch.full(want.shape, float("nan"), dtype=want.dtype, device="cuda")
        launch(out)
        torch.cuda.synchronize()
        if not torch.equal(out, want):
            bad = (out != want).sum().item()
            failures.append(f"{shape} {label} run {r}: {bad} values differ")


def main() -> int:
    from dtrain.lowp.int8 import grouped_gluon as gg  # Gluon: only where the check runs
    from dtrain.lowp.int8 import grouped_triton as igt

    failures = []
    for n, m, k in SHAPES:
        a, b, s = operands(n, m, k)
        ref = ig.grouped_int_mm(a, s, b, torch.float32)
        for tile in gg.TILES:
            runs(f"tile {tile}", partial(gg.launch, a, b, s, tile=tile), ref, (n, m, k), failures)
        for choice in ("auto", "gluon"):  # int8_mm_grouped takes it by default and when chosen
            with igt.grouped_gemm(choice):
                if not igt._takes_gluon(a, b):
                    failures.append(f"{(n, m, k)}: {choice} does not take the Gluon kernel")
                elif not torch.equal(igt.int8_mm_grouped(a, b, s, torch.bfloat16), ref.bfloat16()):
                    failures.append(f"{(n, m, k)}: int8_mm_grouped's bf16 output differs")
    for f in failures:
        print(f)
    print(f"{len(SHAPES)} shapes x {len(gg.TILES)} tiles x {REPEATS}: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
