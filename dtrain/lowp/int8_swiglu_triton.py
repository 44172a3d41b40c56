"""Triton kernels for precision=int8's fused SwiGLU (dtrain/lowp/int8_swiglu.py): the gate's
product with the row-wise quantize of w2's input, and the gate's backward with the row-wise
quantizes of w1's and w3's output gradients, each one kernel.

    swiglu_quantize(a, b) -> (hq, hs)
        a = w1 x, b = w3 x, (M, F) in the compute dtype, row-major. h = silu(a) * b with the
        eager roundings (silu's output to a's dtype, then the product), quantized per row as
        int8.quantize_rowwise(h) does: hq (M, F) int8, hs (M, 1) fp32. h itself never reaches
        memory (w2 reads hq, and SwitchBack's grad-weight dequantizes it).
    swiglu_backward_quantize(dh, a, b) -> (ga, gb, gaq, gas, gbq, gbs)
        dh = dL/dh (M, F). ga = dL/da and gb = dL/db as autograd computes them for
        silu(a) * b (dh * b through silu's backward, and dh * silu(a)), in a's dtype, and each
        quantized per row.

Why: under torch.compile Inductor fuses a quantize into the kernel that produces its input,
and for these two that makes a row reduction over F = 5,632 values (1b) of a pointwise kernel,
which Inductor loops, computing its inputs twice. The twenty-sixth session's 1b trace:
21.5 ms a step for the gate's backward with the two quantizes (bf16's pointwise backward,
7.0 ms) and 7.2 ms for the product with w2's quantize (3.0). Here each program takes
BLOCK_R whole rows: a first sweep computes the values and their abs-max (and, backward,
stores ga and gb, which SwitchBack's grad-weight reads), a second recomputes them from the
same inputs, mostly in L2, and stores the int8 values.

The arithmetic is PyTorch's CUDA kernels' (silu: x / (1 + exp(-x)); its backward:
dy * s * (1 + x * (1 - s)) with s = 1 / (1 + exp(-x)), in fp32 with IEEE division and the
CUDA math library's exp), so on a GPU the results are eager's up to the compilers' choice of
fused multiply-adds. In Triton's interpreter (CPU tests, TRITON_INTERPRET=1) exp is numpy's and
fp32 -> bf16 casts truncate, so there they agree within a bf16 step.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dtrain.lowp.int8_triton import (
    INTERPRET,
    INV_QMAX,
    libdevice,
    quantize_blocks,
    quantize_values,
    row_block,
    row_scales,
)

if INTERPRET:

    @triton.jit
    def _exp(x):
        return tl.exp(x)  # the interpreter has no libdevice

else:

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)  # the CUDA math library's expf, as PyTorch's silu kernels


@triton.jit
def _sigmoid_silu(a):
    """(sigmoid(a), silu(a)) in fp32: 1 / (1 + exp(-a)) and a / (1 + exp(-a))."""
    d = 1.0 + _exp(-a)
    return tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), d), tl.math.div_rn(a, d)


@triton.jit
def _load(ptr, rows, offs_c, ok, C):
    v = tl.load(ptr + rows[:, None] * C + offs_c[None, :], mask=ok, other=0.0)
    return v, v.to(tl.float32)


@triton.jit
def _product(a_ptr, b_ptr, rows, offs_c, ok, C):
    """h = silu(a) * b, each op rounded to the inputs' dtype as eager's, returned in fp32."""
    a, af = _load(a_ptr, rows, offs_c, ok, C)
    _, bf = _load(b_ptr, rows, offs_c, ok, C)
    _, s = _sigmoid_silu(af)
    s = s.to(a.dtype).to(tl.float32)
    return (s * bf).to(a.dtype).to(tl.float32)


@triton.jit
def _swiglu_quantize_kernel(
    a_ptr, b_ptr, q_ptr, scale_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    offs_r, r_ok, rows = row_block(R, BLOCK_R)
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ok = r_ok[:, None] & (offs_c < C)[None, :]
        h = _product(a_ptr, b_ptr, rows, offs_c, ok, C)
        amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1))
    scale = row_scales(amax)
    tl.store(scale_ptr + offs_r, scale, mask=r_ok)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ok = r_ok[:, None] & (offs_c < C)[None, :]
        h = _product(a_ptr, b_ptr, rows, offs_c, ok, C)
        tl.store(q_ptr + rows[:, None] * C + offs_c[None, :], quantize_values(h, scale), mask=ok)


@triton.jit
def _gradients(dh_ptr, a_ptr, b_ptr, rows, offs_c, ok, C):
    """(ga, gb) in a's dtype: autograd's mul backward (dh * b, dh * silu(a), each rounded),
    then silu's backward of the first, as PyTorch's kernels compute them."""
    a, af = _load(a_ptr, rows, offs_c, ok, C)
    _, bf = _load(b_ptr, rows, offs_c, ok, C)
    _, dhf = _load(dh_ptr, rows, offs_c, ok, C)
    sig, s = _sigmoid_silu(af)
    s = s.to(a.dtype).to(tl.float32)  # silu's output, as autograd saved it for the product
    g_silu = (dhf * bf).to(a.dtype).to(tl.float32)
    gb = (dhf * s).to(a.dtype)
    ga = (g_silu * sig * (1.0 + af * (1.0 - sig))).to(a.dtype)
    return ga, gb


@triton.jit
def _swiglu_backward_quantize_kernel(
    dh_ptr,
    a_ptr,
    b_ptr,
    ga_ptr,
    gb_ptr,
    gaq_ptr,
    gas_ptr,
    gbq_ptr,
    gbs_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_r, r_ok, rows = row_block(R, BLOCK_R)
    amax_a = tl.zeros((BLOCK_R,), dtype=tl.float32)
    amax_b = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ok = r_ok[:, None] & (offs_c < C)[None, :]
        ga, gb = _gradients(dh_ptr, a_ptr, b_ptr, rows, offs_c, ok, C)
        out = rows[:, None] * C + offs_c[None, :]
        tl.store(ga_ptr + out, ga, mask=ok)
        tl.store(gb_ptr + out, gb, mask=ok)
        amax_a = tl.maximum(amax_a, tl.max(tl.abs(ga.to(tl.float32)), axis=1))
        amax_b = tl.maximum(amax_b, tl.max(tl.abs(gb.to(tl.float32)), axis=1))
    scale_a = row_scales(amax_a)
    scale_b = row_scales(amax_b)
    tl.store(gas_ptr + offs_r, scale_a, mask=r_ok)
    tl.store(gbs_ptr + offs_r, scale_b, mask=r_ok)
    # Recomputed from dh, a and b rather than reloaded from ga and gb: the same operations give
    # the same values, and no barrier is needed between this program's stores and its loads.
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ok = r_ok[:, None] & (offs_c < C)[None, :]
        ga, gb = _gradients(dh_ptr, a_ptr, b_ptr, rows, offs_c, ok, C)
        out = rows[:, None] * C + offs_c[None, :]
        tl.store(gaq_ptr + out, quantize_values(ga.to(tl.float32), scale_a), mask=ok)
        tl.store(gbq_ptr + out, quantize_values(gb.to(tl.float32), scale_b), mask=ok)


def _check(name: str, *ts: torch.Tensor) -> tuple[int, int]:
    first = ts[0]
    for t in ts:
        if t.dim() != 2 or t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"{name}: 2-d tensors of one shape and dtype, got {list(ts)!r}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name}: float tensors, got {t.dtype}")
    return first.shape


def _launch(kernel, r: int, c: int, device, *args) -> None:
    block_r, block_c, warps = quantize_blocks(r, c, rows_contiguous=True)
    if INTERPRET:
        block_r, block_c = min(block_r, 16), min(block_c, 64)
    grid = (triton.cdiv(r, block_r),)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](*args, r, c, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


@torch.library.custom_op(
    "dtrain::int8_swiglu_quantize",
    mutates_args=(),
    schema="(Tensor a, Tensor b) -> (Tensor, Tensor)",
)
def swiglu_quantize(a, b):
    r, c = _check("swiglu_quantize", a, b)
    a, b = a.contiguous(), b.contiguous()
    q = torch.empty((r, c), dtype=torch.int8, device=a.device)
    scale = torch.empty((r, 1), dtype=torch.float32, device=a.device)
    if r and c:
        _launch(_swiglu_quantize_kernel, r, c, a.device, a, b, q, scale)
    elif r:
        scale.fill_(1e-12).mul_(INV_QMAX.value)  # the kernel's figure for amax 0
    return q, scale


@swiglu_quantize.register_fake
def _(a, b):
    r, c = a.shape
    return a.new_empty((r, c), dtype=torch.int8), a.new_empty((r, 1), dtype=torch.float32)


@torch.library.custom_op(
    "dtrain::int8_swiglu_backward_quantize",
    mutates_args=(),
    schema="(Tensor dh, Tensor a, Tensor b) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def swiglu_backward_quantize(dh, a, b):
    r, c = _check("swiglu_backward_quantize", dh, a, b)
    dh, a, b = dh.contiguous(), a.contiguous(), b.contiguous()
    ga, gb = torch.empty_like(a), torch.empty_like(a)
    gaq = torch.empty((r, c), dtype=torch.int8, device=a.device)
    gbq = torch.empty_like(gaq)
    gas = torch.empty((r, 1), dtype=torch.float32, device=a.device)
    gbs = torch.empty_like(gas)
    if r and c:
        _launch(
            _swiglu_backward_quantize_kernel, r, c, a.device, dh, a, b, ga, gb, gaq, gas, gbq, gbs
        )
    elif r:
        gas.fill_(1e-12).mul_(INV_QMAX.value)
        gbs.fill_(1e-12).mul_(INV_QMAX.value)
    return ga, gb, gaq, gas, gbq, gbs


@swiglu_backward_quantize.register_fake
def _(dh, a, b):
    r, c = a.shape
    q = a.new_empty((r, c), dtype=torch.int8)
    s = a.new_empty((r, 1), dtype=torch.float32)
    return a.new_empty((r, c)), a.new_empty((r, c)), q, s, q.new_empty((r, c)), s.new_empty((r, 1))
