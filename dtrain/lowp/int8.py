"""int8 training for linear layers: all three matmuls on int8 tensor cores, inputs saved in int8.

For y = x W^T with x (M, K) activations and W (N, K) the fp32 master weight:

    forward      y  = x W^T     x row-wise (per token), W row-wise (per output channel)
    grad_input   dx = dy W      dy row-wise (per token), W column-wise (per input channel)
    grad_weight  dW = dy^T x    reduces over tokens: see below

Each operand is quantized symmetrically to [-127, 127] with one fp32 scale per row of the
reduction (`quantize_rowwise`), so the scales factor out of the sum and the int32 result of
`torch._int_mm` is dequantized by an outer product of two scale vectors.

Only the int8 x and its per-token scales are saved for backward (1 byte per element instead of
bf16's 2). The grad_weight matmul needs x with scales that do not vary along the tokens it sums
over; rather than dequantize and quantize x again (a second rounding), the per-token scales are
folded into dy:

    dW[n, k] = sum_m dy[m, n] x[m, k] = sum_m (dy[m, n] sx[m]) xq[m, k]

so the saved xq is used as is and only (dy * sx) is quantized, per output channel n.

That quantization is the coarsest of the three: one scale per output channel over every token of
the batch, so a few large gradients flatten the rest. With `grad_weight="bf16"` (SwitchBack,
Wortsman et al. 2023, "Stable and low-precision training for large-scale vision-language
models") grad_weight instead runs in the compute dtype from the same saved int8 input,

    dW = dy^T (xq * sx)        xq * sx dequantized to the compute dtype (bf16 under autocast)

so nothing more is saved (memory is unchanged), dy is not quantized for it, and forward and
grad_input stay int8: two int8 matmuls per linear instead of three.

Operand layouts follow what int8 GEMMs want (cuBLASLt's "TN": first operand row-major, second
column-major), so no int8 copy is needed except the transpose of xq for grad_weight. Every
quantize is a row reduction plus a pointwise op, which torch.compile fuses into one kernel
(including the transposes); eagerly each is a few passes over the tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Symmetric int8: [-127, 127] (not -128, so negation is exact and the grid is symmetric).
QMAX = 127.0
# int32 accumulation overflows past 2**31 / 127**2 = 133,143 products of full-scale values;
# longer reductions (grad_weight over many tokens) are split into chunks this long.
MAX_REDUCTION = 131072
# How grad_weight is computed: "int8" (torch._int_mm, like forward and grad_input) or "bf16"
# (SwitchBack: a matmul in the compute dtype from the dequantized int8 input).
GRAD_WEIGHT_MODES = ("int8", "bf16")


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) float -> q (R, C) int8 row-major, scale (R, 1) fp32, with x ~ q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / QMAX
    q = (xf / scale).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale


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


class _Int8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, int8_grad_weight):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        xq, xs = quantize_rowwise(x2)  # (M, K) int8, (M, 1)
        wq, ws = quantize_rowwise(weight)  # (N, K) int8, (N, 1)
        y = scaled_int_mm(xq, xs, wq.t(), ws.t(), out_dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # The weight is the parameter itself (no copy); the input only as int8 + scales.
        ctx.save_for_backward(xq, xs, weight)
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = shape, x.dtype, bias is not None
        ctx.out_dtype, ctx.int8_grad_weight = out_dtype, int8_grad_weight
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xq, xs, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gq, gs = quantize_rowwise(g)  # per token, over N
            wtq, wts = quantize_rowwise(weight.t())  # (K, N): per input channel, over N
            grad_x = scaled_int_mm(gq, gs, wtq.t(), wts.t(), ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1] and ctx.int8_grad_weight:
            # Fold the per-token input scales into dy (see the module docstring), then
            # quantize per output channel over the tokens: (N, M) int8, (N, 1).
            gtq, gts = quantize_rowwise((g.float() * xs).t())
            xq_colmajor = xq.t().contiguous().t()  # (M, K) column-major for the int8 GEMM
            grad_w = scaled_int_mm(gtq, gts, xq_colmajor, 1.0, weight.dtype)  # (N, K)
        elif ctx.needs_input_grad[1]:
            # SwitchBack: dequantize the saved input (in fp32, one rounding to the compute
            # dtype) and multiply in the compute dtype, as a bf16 linear's grad_weight does.
            x_deq = (xq.float() * xs).to(ctx.out_dtype)  # (M, K)
            grad_w = torch.mm(g.to(ctx.out_dtype).t(), x_deq).to(weight.dtype)  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


def _check_grad_weight(grad_weight: str) -> None:
    if grad_weight not in GRAD_WEIGHT_MODES:
        raise ValueError(f"grad_weight={grad_weight!r}; choose one of {GRAD_WEIGHT_MODES}")


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    grad_weight: str = "int8",
) -> torch.Tensor:
    """F.linear with int8 matmuls. Returns autocast's dtype inside autocast, else x's dtype.

    `grad_weight`: "int8" (all three matmuls int8) or "bf16" (SwitchBack: grad_weight in the
    compute dtype from the saved int8 input).
    """
    _check_grad_weight(grad_weight)
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return _Int8LinearFn.apply(x, weight, bias, out_dtype, grad_weight == "int8")


class Int8Linear(nn.Linear):
    """An nn.Linear whose matmuls run in int8. Same parameters, names and state dict as the
    nn.Linear it replaces (the swap only changes the class), so DDP, fully_shard, optimizers
    and checkpoints are unaffected."""

    # A plain attribute (set per instance by apply_int8): torch.compile treats it as a constant.
    grad_weight: str = "int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.bias, grad_weight=self.grad_weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, grad_weight={self.grad_weight}"


def apply_int8(
    module: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool],
    *,
    grad_weight: str = "int8",
) -> int:
    """Swap, in place, every nn.Linear in `module` for which filter_fn(linear, fqn) holds;
    `grad_weight` ("int8" or "bf16") is how the swapped layers compute grad_weight.

    Returns the number of layers swapped.
    """
    _check_grad_weight(grad_weight)
    n = 0
    for fqn, m in module.named_modules():
        if type(m) is nn.Linear and filter_fn(m, fqn):
            m.__class__ = Int8Linear
            m.grad_weight = grad_weight
            n += 1
    return n
