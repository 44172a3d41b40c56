"""precision=int8's grad-weight in int8 with one scale per output channel per 128 tokens
(`precision.int8_grad_weight=int8_grouped`).

dW = dy^T x sums over the tokens. The saved input is int8 with one scale per token (sx), which
dtrain/lowp/int8/linear.py folds into dy, so the saved codes are used as they are:

    dW[n, k] = sum_m (dy[m, n] sx[m]) xq[m, k]

Its "int8" mode then quantizes g = dy * sx per output channel over every token of the batch: a
few tokens with large gradients flatten the rest (29 dB against fp32 in tests/test_precision.py,
where SwitchBack's bf16 grad-weight reaches 42). Here g takes one scale per output channel per
group of GROUP consecutive tokens, the fine-grained scaling DeepSeek-V3 gives its fp8 GEMMs
(1 x 128 tiles along the reduction):

    s[n, j]  = max over the tokens m of group j of |g[m, n]|, times 1/127
    gq[n, m] = round(g[m, n] / s[n, j])                          int8, (N, M): tokens contiguous
    dW[n, k] = sum over the groups j, in order, of float(sum_{m in j} gq[n, m] xq[m, k]) * s[n, j]

Each group's integer sum is exact (at most 128 * 127^2 < 2^24, so exact in fp32 too); it is
scaled and added to an fp32 accumulator group by group, the multiply and the add one fused
multiply-add rounded once (`fma_f32` here, fma.rn.f32 in the kernels): two instructions a value
in the GEMM's promotion where rounding them apart takes three, which made the Gluon kernel 7-11%
faster (raw outputs of 2026-12-02), and one rounding, not two. A loud token now flattens
only its own group's 127 neighbours. The GEMM reads gq with the tokens contiguous and xq
column-major (both operands K-major, what Hopper's int8 wgmma reads), so xq is transposed once
per layer, as in the "int8" mode.

Two implementations, the same numbers (the same fp32 operations in the same order):
dtrain/lowp/int8/grouped_triton.py (Triton kernels: the GEMM with the promotion in its K loop,
on Hopper, and the quantize in one pass) and the torch ops here (`quantize_groups`, and
`grouped_int_mm`: one torch._int_mm per group, portable, slow on long reductions; CPU tests and
GPUs without the Triton kernels). Under torch.compile the quantize is the Triton op where
DTRAIN_INT8_QUANTIZE keeps the output gradients' apart (its default), else the torch ops,
which Inductor fuses; run eagerly, the torch ops make full-size fp32 temporaries of dy (about
370 MB each for 1b's w1 at 16,384 tokens).

Speed, measured (1x H200, raw outputs of 2026-12-03, with the fused multiply-add): the
Triton GEMM runs at 0.98-1.18x cuBLAS's bf16 on 1b's and 8b's grad-weights, since each group's
promotion waits for its wgmma and the next wgmma for the promotion. On Hopper the Gluon GEMM
(dtrain/lowp/int8/grouped_gluon.py), two warpgroups taking turns, runs at 1.47x over 1b's block,
and the mode at 1.107x bf16 in training against the default's 1.087x: the GEMM saves about 15 ms
a step, the group quantize of dy spends 14 of them again. It stays an option, not the default,
for its loss at 350m (+4.0% and +2.5% on one seed of two; docs/precision.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtrain.lowp.int8.quant import (  # noqa: F401 - GROUP and group_count named here too
    GROUP,
    INV_QMAX,
    codes,
    group_count,
    int_mm,
    triton_applies,
)


def quantize_groups(g: torch.Tensor, token_scale: torch.Tensor):
    """g (M, N), token_scale (M, 1) -> gq (N, M) int8 row-major, scales (N, ceil(M / GROUP))
    fp32 (a transposed view): g * token_scale quantized per column per GROUP rows, transposed
    (tokens contiguous).
    The arithmetic is int8.quantize_rowwise's: abs-max * fp32(1/127), then int8.codes (times
    the scale's reciprocal, round half to even, clamp to [-127, 127])."""
    m, n = g.shape
    v = g.float() * token_scale.reshape(-1, 1)
    groups = group_count(m)
    v = F.pad(v, (0, 0, 0, groups * GROUP - m)).view(groups, GROUP, n)  # zeros: codes of 0
    scale = v.abs().amax(dim=1).clamp_min(1e-12) * INV_QMAX  # (groups, N)
    q = codes(v, scale[:, None, :])
    q = q.view(groups * GROUP, n)[:m]
    # The scales as a transposed view, (N, groups) with strides (1, N): the GEMM loads one
    # group's scales for a tile of rows each K step, contiguous in memory this way.
    return q.t().contiguous(), scale.t()


def grouped_int_mm(
    aq: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """aq (N, M) int8, a_scale (N, ceil(M / GROUP)) fp32, b (M, K) int8 -> (N, K) out_dtype:
    the sum over the groups j, in order, of float(aq[:, j] @ b[j]) * a_scale[:, j], in fp32,
    each group's product and sum one fused multiply-add (the kernels' bits)."""
    out = torch.zeros((aq.shape[0], b.shape[1]), dtype=torch.float32, device=aq.device)
    for j in range(a_scale.shape[1]):
        lo, hi = j * GROUP, (j + 1) * GROUP
        part = int_mm(aq[:, lo:hi].contiguous(), b[lo:hi].t().contiguous().t())
        out = fma_f32(part.float(), a_scale[:, j : j + 1], out)
    return out.to(out_dtype)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c for fp32 tensors (broadcast), rounded once to fp32 as a fused multiply-add
    (fma.rn.f32) rounds: torch has no such op. In fp64 the product is exact (24 + 24 bits of
    53); the sum is made round-to-odd (its exact error by TwoSum: where it is not zero and the
    sum's last bit is even, the sum steps one ulp toward it), and round-to-odd at 53 bits then
    rounded to 24 is the exact sum correctly rounded (Boldo and Melquiond: any precision at
    least two bits more than the target's)."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    v = s - p
    err = (p - (s - v)) + (c - v)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(s.dtype)
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def grad_weight_grouped(
    g, xq, xs, weight_dtype: torch.dtype, kernel: str, apart: bool
) -> torch.Tensor:
    """dW (N, K) in weight_dtype from the output gradient g (M, N) and the saved int8 input
    xq (M, K) with its per-token scales xs (M, 1), on the chosen kernels. On the Triton kernels
    the quantize is their op eagerly, and under torch.compile when `apart` (DTRAIN_INT8_QUANTIZE
    keeps the output gradients' quantizes apart: its default); else Inductor fuses the torch
    ops above, as int8._quantize does for the others."""
    xq_colmajor = xq.t().contiguous().t()  # (M, K) column-major: K-major for the GEMM
    if not (kernel == "triton" and triton_applies(g)):
        return grouped_int_mm(*quantize_groups(g, xs), xq_colmajor, weight_dtype)
    from dtrain.lowp.int8 import grouped_triton as igt  # registers the dtrain:: ops

    if apart or not torch.compiler.is_compiling():
        gq, gs = igt.quantize_groups_op(g, xs)  # (N, M), (N, groups)
    else:
        gq, gs = quantize_groups(g, xs)
    return igt.int8_mm_grouped(gq, xq_colmajor, gs, weight_dtype)
