"""bench/dy_quantize.py's Triton kernels: the roof and the tile-local quantize, and the
approximate reciprocal a value in place of the quantize's exact arithmetic. Defined here, not in
dtrain, since they exist to be measured; a module of their own so that they are defined after
TRITON_INTERPRET is set (--smoke)."""

from __future__ import annotations

import triton
import triton.language as tl

from dtrain.lowp.int8.triton_gemm import _rint, row_scales


@triton.jit
def quantize_values_mul(v, scale):
    """triton_gemm.quantize_values with Triton's approximate reciprocal (`1.0 / s`, div.full)
    a value in place of its IEEE reciprocal a row."""
    y = _rint(v * (1.0 / tl.broadcast_to(scale[:, None], v.shape)))
    return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)


@triton.jit
def _codes(v, scale, MUL: tl.constexpr):
    """The codes with that multiply (MUL), or with an IEEE division a value (the arithmetic the
    quantizes had before int8.codes)."""
    if MUL:
        q = quantize_values_mul(v, scale)
    else:
        y = _rint(tl.math.div_rn(v, tl.broadcast_to(scale[:, None], v.shape)))
        q = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)
    return q


@triton.jit
def tile_kernel(
    g_ptr, q_ptr, qt_ptr, M, N,
    ROUND: tl.constexpr, MUL: tl.constexpr, BOTH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One (BLOCK_M, BLOCK_N) tile of dy: int8 row-major, and transposed where BOTH; with ROUND
    # the codes over each row's and each column's in-tile abs-max, else a plain cast.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = offs_m.to(tl.int64), offs_n.to(tl.int64)
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    g = tl.load(g_ptr + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if ROUND:
        q = _codes(g, row_scales(tl.max(tl.abs(g), axis=1)), MUL)
    else:
        q = g.to(tl.int8)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=ok)
    if BOTH:
        gt = tl.trans(g)
        if ROUND:
            qt = _codes(gt, row_scales(tl.max(tl.abs(gt), axis=1)), MUL)
        else:
            qt = gt.to(tl.int8)
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], qt, mask=tl.trans(ok))
