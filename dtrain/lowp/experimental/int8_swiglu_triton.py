"""Triton kernels for precision=int8's fused SwiGLU (int8_swiglu.py beside it): the gate's
product with the row-wise quantize of w2's input, and the gate's backward with the row-wise
quantizes of w1's and w3's output gradients, each one kernel.

    swiglu_quantize(a, b) -> (hq, hs)
        a = w1 x, b = w3 x, (M, F) in the compute dtype, row-major. h = silu(a) * b with the
        eager roundings (silu's output to a's dtype, then the product), quantized per row as
        int8.quantize_rowwise(h) does: hq (M, F) int8, hs (M, 1) fp32. h itself never reaches
        memory (w2 reads hq, and SwitchBack's grad-weight dequantizes it).
    swiglu_backward_quantize(dh, a, b) -> (ga, gb, gaq, gas, gbq, gbs, hq, hs)
        dh = dL/dh (M, F). ga = dL/da and gb = dL/db as autograd computes them for
        silu(a) * b (dh * b through silu's backward, and dh * silu(a)), in a's dtype, and each
        quantized per row; and hq, hs recomputed, the same bits as swiglu_quantize's, for
        w2's grad-weight (the forward's are not kept: silu(a) is computed here anyway, and
        w2's int8 input would be M x F bytes a layer more memory than the three linears keep
        under torch.compile, whose partitioner recomputes it from a and b).

Why: under torch.compile Inductor fuses a quantize into the kernel that produces its input,
and for these two that makes a row reduction over F = 5,632 values (1b) of a pointwise kernel,
which Inductor loops, computing its inputs twice. A 1b trace (`bash bench/lowp.sh profile1b`):
21.5 ms a step for the gate's backward with the two quantizes (bf16's pointwise backward,
7.0 ms) and 7.2 ms for the product with w2's quantize (3.0). Here each program takes
BLOCK_R whole rows, in one of two ways (autotuning chooses the way and the tile per shape,
among _TILES):
  - one pass, for rows of up to ONE_PASS_MAX values: the whole row is one tile, so its values
    are computed once, kept in registers for the abs-max and quantized from there;
  - two sweeps, for rows of any length (past ONE_PASS_MAX the only way): a first computes
    the values and their abs-max, a second recomputes them from the same inputs, mostly in
    L2, and stores the int8 values.
Either way the backward also stores ga and gb, which SwitchBack's grad-weight reads. A 1b
trace put the two sweeps at 27.4 ms a step (backward) and 10.3 (forward), slower than
Inductor's looped reductions, on a tile of 2 x 2,048 values at 8 warps: each value is loaded
and computed twice (an exp and two IEEE divisions), plus the quantize's division, and the
backward's 97 registers a thread (ptxas for sm_90a) leave room for two programs of 8 warps a
multiprocessor. One pass does each once.

The arithmetic is torch.compile's (what Inductor makes of silu and its backward, which the
compiled three linears and bf16 training run): sigmoid(a) = 1 / (1 + exp(-a)) with Triton's
approximate exp (ex2) and division (div.full), silu(a) = a * sigmoid(a), and the backward
dy * s * (1 + a * (1 - s)) with s = sigmoid(a), in fp32. PyTorch's eager kernels compute the same
formulas with the CUDA math library's expf and IEEE divisions, so on a GPU the results are
eager's within a few fp32 ulps before rounding: the GPU tests hold them to one bf16 step apart
in at most a thousandth of the values. These kernels use neither IEEE divisions (two a value,
each a branch to a slow path) nor per-tile abs-max reductions across the program's warps (a
barrier each tile; each thread keeps its columns' maxima instead, reduced once a row): with
them the kernels were slower than Inductor's loops. In Triton's interpreter (CPU
tests, TRITON_INTERPRET=1) exp is numpy's and fp32 -> bf16 casts truncate, so there they agree
within a bf16 step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dtrain.lowp.int8.triton_gemm import (
    INV_QMAX,
    chosen_configs,
    launch_rows,
    quantize_values,
    row_block,
    row_scales,
    row_tile_configs,
    tuned_rows,
)


@triton.jit
def _sigmoid_silu(a):
    """(sigmoid(a), silu(a)) in fp32 as Inductor computes them (the module's docstring): Triton's
    sigmoid and a * sigmoid(a), no IEEE division."""
    sig = tl.sigmoid(a)
    return sig, a * sig


@triton.jit
def _load(ptr, rows, offs_c, ok, C):
    v = tl.load(ptr + rows[:, None] * C + offs_c[None, :], mask=ok, other=0.0)
    return v, v.to(tl.float32)


@triton.jit
def _gate(a, af, bf):
    """(sigmoid(a), s = silu(a), h = s * b) in fp32, s and h each rounded to a's dtype as eager
    rounds them: the forward's h and the backward's recomputed one are these same operations."""
    sig, s = _sigmoid_silu(af)
    s = s.to(a.dtype).to(tl.float32)
    return sig, s, (s * bf).to(a.dtype).to(tl.float32)


@triton.jit
def _product(a_ptr, b_ptr, rows, offs_c, ok, C):
    """h = silu(a) * b, as _gate rounds it, in fp32."""
    a, af = _load(a_ptr, rows, offs_c, ok, C)
    _, bf = _load(b_ptr, rows, offs_c, ok, C)
    _, _, h = _gate(a, af, bf)
    return h


@triton.jit
def _store_codes(q_ptr, v, scale, rows, offs_c, ok, C):
    out = rows[:, None] * C + offs_c[None, :]
    tl.store(q_ptr + out, quantize_values(v.to(tl.float32), scale), mask=ok)


@triton.jit
def _abs_max(g):
    return tl.max(tl.abs(g.to(tl.float32)), axis=1)


@triton.jit
def _swiglu_quantize_kernel(
    a_ptr,
    b_ptr,
    q_ptr,
    scale_ptr,
    R,
    C,
    ROW_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SWEEP_C: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    offs_r, r_ok, rows = row_block(R, BLOCK_R)
    if ONE_PASS:  # ROW_C >= C: each row is one tile, computed once
        offs_c = tl.arange(0, ROW_C)
        ok = r_ok[:, None] & (offs_c < C)[None, :]
        h = _product(a_ptr, b_ptr, rows, offs_c, ok, C)  # 0 where masked: no effect on amax
        scale = row_scales(_abs_max(h))
        tl.store(scale_ptr + offs_r, scale, mask=r_ok)
        _store_codes(q_ptr, h, scale, rows, offs_c, ok, C)
    else:
        # abs-maxes per thread, reduced once after the sweep, as triton_gemm's quantize's
        amax = tl.zeros((BLOCK_R, SWEEP_C), dtype=tl.float32)
        for c0 in range(0, C, SWEEP_C):
            offs_c = c0 + tl.arange(0, SWEEP_C)
            ok = r_ok[:, None] & (offs_c < C)[None, :]
            h = _product(a_ptr, b_ptr, rows, offs_c, ok, C)
            amax = tl.maximum(amax, tl.abs(h))
        scale = row_scales(tl.max(amax, axis=1))
        tl.store(scale_ptr + offs_r, scale, mask=r_ok)
        for c0 in range(0, C, SWEEP_C):
            offs_c = c0 + tl.arange(0, SWEEP_C)
            ok = r_ok[:, None] & (offs_c < C)[None, :]
            h = _product(a_ptr, b_ptr, rows, offs_c, ok, C)
            _store_codes(q_ptr, h, scale, rows, offs_c, ok, C)


@triton.jit
def _gradients(dh_ptr, a_ptr, b_ptr, rows, offs_c, ok, C):
    """(ga, gb, h): ga and gb in a's dtype, autograd's mul backward (dh * b, dh * silu(a), each
    rounded), then silu's backward of the first, in its formula, with Inductor's sigmoid; and the
    forward's h = silu(a) * b in fp32, as _product computes it."""
    a, af = _load(a_ptr, rows, offs_c, ok, C)
    _, bf = _load(b_ptr, rows, offs_c, ok, C)
    _, dhf = _load(dh_ptr, rows, offs_c, ok, C)
    sig, s, h = _gate(a, af, bf)  # s: silu's output, as autograd saved it for the product
    g_silu = (dhf * bf).to(a.dtype).to(tl.float32)
    gb = (dhf * s).to(a.dtype)
    ga = (g_silu * sig * (1.0 + af * (1.0 - sig))).to(a.dtype)
    return ga, gb, h


@triton.jit
def _store_gradients(ga_ptr, gb_ptr, ga, gb, rows, offs_c, ok, C):
    out = rows[:, None] * C + offs_c[None, :]
    tl.store(ga_ptr + out, ga, mask=ok)
    tl.store(gb_ptr + out, gb, mask=ok)


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
    hq_ptr,
    hs_ptr,
    R,
    C,
    ROW_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SWEEP_C: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    offs_r, r_ok, rows = row_block(R, BLOCK_R)
    if ONE_PASS:  # ROW_C >= C: each row is one tile, its values computed once
        offs_c = tl.arange(0, ROW_C)
        ok = r_ok[:, None] & (offs_c < C)[None, :]
        ga, gb, h = _gradients(dh_ptr, a_ptr, b_ptr, rows, offs_c, ok, C)  # 0 where masked
        _store_gradients(ga_ptr, gb_ptr, ga, gb, rows, offs_c, ok, C)
        scale_a = row_scales(_abs_max(ga))
        scale_b = row_scales(_abs_max(gb))
        scale_h = row_scales(_abs_max(h))
    else:
        # abs-maxes per thread, reduced once after the sweep, as triton_gemm's quantize's
        amax_a = tl.zeros((BLOCK_R, SWEEP_C), dtype=tl.float32)
        amax_b = tl.zeros((BLOCK_R, SWEEP_C), dtype=tl.float32)
        amax_h = tl.zeros((BLOCK_R, SWEEP_C), dtype=tl.float32)
        for c0 in range(0, C, SWEEP_C):
            offs_c = c0 + tl.arange(0, SWEEP_C)
            ok = r_ok[:, None] & (offs_c < C)[None, :]
            ga, gb, h = _gradients(dh_ptr, a_ptr, b_ptr, rows, offs_c, ok, C)
            _store_gradients(ga_ptr, gb_ptr, ga, gb, rows, offs_c, ok, C)
            amax_a = tl.maximum(amax_a, tl.abs(ga.to(tl.float32)))
            amax_b = tl.maximum(amax_b, tl.abs(gb.to(tl.float32)))
            amax_h = tl.maximum(amax_h, tl.abs(h))
        scale_a = row_scales(tl.max(amax_a, axis=1))
        scale_b = row_scales(tl.max(amax_b, axis=1))
        scale_h = row_scales(tl.max(amax_h, axis=1))
    tl.store(gas_ptr + offs_r, scale_a, mask=r_ok)
    tl.store(gbs_ptr + offs_r, scale_b, mask=r_ok)
    tl.store(hs_ptr + offs_r, scale_h, mask=r_ok)
    if ONE_PASS:
        _store_codes(gaq_ptr, ga, scale_a, rows, offs_c, ok, C)
        _store_codes(gbq_ptr, gb, scale_b, rows, offs_c, ok, C)
        _store_codes(hq_ptr, h, scale_h, rows, offs_c, ok, C)
    else:
        # Recomputed from dh, a and b rather than reloaded from ga and gb: the same operations
        # give the same values, and no barrier is needed between this program's stores and
        # its loads.
        for c0 in range(0, C, SWEEP_C):
            offs_c = c0 + tl.arange(0, SWEEP_C)
            ok = r_ok[:, None] & (offs_c < C)[None, :]
            ga, gb, h = _gradients(dh_ptr, a_ptr, b_ptr, rows, offs_c, ok, C)
            _store_codes(gaq_ptr, ga, scale_a, rows, offs_c, ok, C)
            _store_codes(gbq_ptr, gb, scale_b, rows, offs_c, ok, C)
            _store_codes(hq_ptr, h, scale_h, rows, offs_c, ok, C)


def _check(name: str, *ts: torch.Tensor) -> tuple[int, int]:
    first = ts[0]
    for t in ts:
        if t.dim() != 2 or t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"{name}: 2-d tensors of one shape and dtype, got {list(ts)!r}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name}: float tensors, got {t.dtype}")
    return first.shape


# (ONE_PASS, BLOCK_R, SWEEP_C, num_warps) autotuning chooses among per (R, C). The two sweeps' 2 x
# 2,048 at 8 warps is the tile a 1b trace timed at 27.4 ms a step backward (with 97 registers a
# thread: two programs a multiprocessor), so smaller tiles (fewer registers, more programs in
# flight) are in the list too. Registers a thread of the backward for sm_90a (ptxas, with the
# runtime's 16-byte alignment hints, none spilled; Triton 3.6): one pass of 8,192 at 8/16/32 warps
# 128/77/51; sweeps 2 x 2,048 at 8 warps 123, 1 x 2,048 at 8 48, 1 x 1,024 at 4 48, 1 x 512 at 4 32
# (the forward's: 30-49). At 1b autotuning chose one pass at 8 warps for the forward and sweeps of 1
# x 2,048 for the backward (`PRECS='bf16 int8swiglu' bash bench/lowp.sh single1b`; raw outputs in
# git history: bench/results/README.md).
_TILES = [
    (True, 1, 1, 8),
    (True, 1, 1, 16),
    (True, 1, 1, 32),
    (False, 2, 2048, 8),
    (False, 1, 2048, 8),
    (False, 1, 1024, 4),
    (False, 1, 512, 4),
]
_CONFIGS = row_tile_configs(_TILES)
# One pass only for rows up to ONE_PASS_MAX (triton_gemm.prune_row_tiles says why the bound).
_swiglu_quantize_tuned = tuned_rows(_swiglu_quantize_kernel, _CONFIGS, ["R", "C"])
_swiglu_backward_quantize_tuned = tuned_rows(_swiglu_backward_quantize_kernel, _CONFIGS, ["R", "C"])


def tuned_configs() -> dict:
    """{"forward" or "backward": {(R, C, dtypes...): the config autotuning chose}} so far."""
    return chosen_configs(forward=_swiglu_quantize_tuned, backward=_swiglu_backward_quantize_tuned)


def gate_quantize(a, b, *, one_pass: bool | None = None):
    """swiglu_quantize's computation; `one_pass` (True or False) forces a fixed tile of one
    pass or two sweeps (tests and benchmarks), else autotuning chooses."""
    r, c = _check("swiglu_quantize", a, b)
    a, b = a.contiguous(), b.contiguous()
    q = torch.empty((r, c), dtype=torch.int8, device=a.device)
    scale = torch.empty((r, 1), dtype=torch.float32, device=a.device)
    if r and c:
        kernel, tuned = _swiglu_quantize_kernel, _swiglu_quantize_tuned
        launch_rows(kernel, tuned, r, c, a.device, (a, b, q, scale, r, c), one_pass)
    elif r:
        scale.fill_(1e-12).mul_(INV_QMAX.value)  # the kernel's figure for amax 0
    return q, scale


def gate_backward_quantize(dh, a, b, *, one_pass: bool | None = None):
    """swiglu_backward_quantize's computation; `one_pass` as gate_quantize's."""
    r, c = _check("swiglu_backward_quantize", dh, a, b)
    dh, a, b = dh.contiguous(), a.contiguous(), b.contiguous()
    ga, gb = torch.empty_like(a), torch.empty_like(a)
    gaq, gbq, hq = (torch.empty((r, c), dtype=torch.int8, device=a.device) for _ in range(3))
    gas, gbs, hs = (torch.empty((r, 1), dtype=torch.float32, device=a.device) for _ in range(3))
    if r and c:
        args = (dh, a, b, ga, gb, gaq, gas, gbq, gbs, hq, hs, r, c)
        kernel, tuned = _swiglu_backward_quantize_kernel, _swiglu_backward_quantize_tuned
        launch_rows(kernel, tuned, r, c, a.device, args, one_pass)
    elif r:
        for scale in (gas, gbs, hs):
            scale.fill_(1e-12).mul_(INV_QMAX.value)  # the kernel's figure for amax 0
    return ga, gb, gaq, gas, gbq, gbs, hq, hs


@torch.library.custom_op(
    "dtrain::int8_swiglu_quantize",
    mutates_args=(),
    schema="(Tensor a, Tensor b) -> (Tensor, Tensor)",
)
def swiglu_quantize(a, b):
    return gate_quantize(a, b)


@swiglu_quantize.register_fake
def _(a, b):
    r, c = a.shape
    return a.new_empty((r, c), dtype=torch.int8), a.new_empty((r, 1), dtype=torch.float32)


@torch.library.custom_op(
    "dtrain::int8_swiglu_backward_quantize",
    mutates_args=(),
    schema="(Tensor dh, Tensor a, Tensor b) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def swiglu_backward_quantize(dh, a, b):
    return gate_backward_quantize(dh, a, b)


@swiglu_backward_quantize.register_fake
def _(dh, a, b):
    r, c = a.shape
    q = [a.new_empty((r, c), dtype=torch.int8) for _ in range(3)]
    s = [a.new_empty((r, 1), dtype=torch.float32) for _ in range(3)]
    return a.new_empty((r, c)), a.new_empty((r, c)), q[0], s[0], q[1], s[1], q[2], s[2]
