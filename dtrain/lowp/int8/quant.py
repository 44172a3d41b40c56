"""precision=int8's arithmetic that every int8 module shares: the symmetric row-wise quantize,
the int8 matmul through torch._int_mm and its dequantization, the grouped scales' group size.
dtrain/lowp/int8/linear.py's docstring says how the layer uses them."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# Symmetric int8: [-127, 127] (not -128, so negation is exact and the grid is symmetric).
QMAX = 127.0
# The scale is amax * fp32(1/127), not amax / 127: CUDA's eager `tensor / python_scalar` is a
# multiply by the reciprocal (1 ulp off true division in ~4.5% of rows), CPU's a true division;
# an explicit multiply gives the same bits on CPU, CUDA and in the Triton kernel.
INV_QMAX = 1.0 / QMAX
# int32 accumulation overflows past 2**31 / 127**2 = 133,143 products of full-scale values;
# longer reductions (grad_weight over many tokens) are split into chunks this long.
MAX_REDUCTION = 131072
# Triton's interpreter runs the Triton kernels on CPU tensors (CPU tests of the kernels).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tokens per scale: the GEMM's BLOCK_K, so each K step of its loop is one group.
GROUP = 128


def group_count(tokens: int) -> int:
    """Groups of GROUP tokens (the last one may be short): one scale per channel each."""
    return -(-tokens // GROUP)


def codes(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values over their scales (broadcast) -> int8: v times the scale's reciprocal (an
    IEEE division a scale, not a value), rounded half to even, clamped to [-127, 127]. The
    kernels compute the same bits (triton_gemm.quantize_values). A multiply, not v / scale:
    an IEEE division a value bounded the Triton quantizes on an H200 (a tile kernel quantizing
    1b's 16,384 x 5,632 output gradient both ways: 0.379 ms with it, 0.152 with the multiply;
    the row-wise op now runs at a plain copy's speed, 0.074 ms against 0.071:
    raw outputs of 2026-12-03), and the result is at most one code from the division's
    (the product is within about an ulp of the quotient)."""
    return (v * torch.reciprocal(scale)).round_().clamp_(-QMAX, QMAX).to(torch.int8)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) float -> q (R, C) int8 row-major, scale (R, 1) fp32, with x ~ q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) * INV_QMAX
    return codes(xf, scale).contiguous(), scale


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def int_mm(a: torch.Tensor, b: torch.Tensor, *, pad: bool | None = None) -> torch.Tensor:
    """int8 (M, K) @ (K, N) -> int32 (M, N) via torch._int_mm, within its constraints.

    `a` should be row-major and `b` column-major (b.t() contiguous). On CUDA _int_mm needs
    M > 16 and K, N multiples of 8; other shapes are zero-padded (zeros add nothing to the dot
    products) and the result sliced. Reductions longer than MAX_REDUCTION are chunked so the
    int32 accumulator cannot overflow; the partial sums are added in fp32 (far more precise
    than the int8 inputs). `pad` forces (True) or skips (False) the padding; None: on CUDA.
    """
    m, k = a.shape
    n = b.shape[1]
    if k > MAX_REDUCTION:
        out = None
        for s in range(0, k, MAX_REDUCTION):
            a_part = a[:, s : s + MAX_REDUCTION].contiguous()
            b_part = b[s : s + MAX_REDUCTION].t().contiguous().t()  # column-major
            part = int_mm(a_part, b_part, pad=pad).float()
            out = part if out is None else out + part
        return out
    if k == 1:
        # An outer product. torch._int_mm on CPU returns garbage for K = 1 (torch 2.13: every
        # (M, N) tried, b (1, N) with strides (1, 1)), which a short last group of
        # int8_grouped's reduction can be.
        return a.int() * b.int()
    if pad is None:
        pad = a.device.type == "cuda"
    if pad and (m <= 16 or k % 8 or n % 8):
        mp, kp, np_ = max(_round_up(m, 8), 24), _round_up(k, 8), _round_up(n, 8)
        a = F.pad(a, (0, kp - k, 0, mp - m))
        b = F.pad(b.t(), (0, kp - k, 0, np_ - n)).t()  # stays column-major
        return torch._int_mm(a, b)[:m, :n]
    return torch._int_mm(a, b)


def scaled_int_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale) with a (M, K) int8, a_scale (M, 1), b (K, N) int8,
    b_scale (1, N): the int32 product dequantized by the outer product of the scales."""
    return (int_mm(a, b) * a_scale * b_scale).to(out_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def triton_applies(t: torch.Tensor) -> bool:
    # The Triton kernels need CUDA tensors (or the interpreter); a "triton" layer that meets
    # CPU tensors (e.g. FSDP built on meta, then run on CPU) takes the portable path.
    return t.is_cuda or INTERPRET
