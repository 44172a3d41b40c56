"""torchao's AdamW8bit step for one tensor in one Triton kernel (dtrain/lowp/optim8bit/adamw.py
takes it on CUDA for fp32 parameters whose two moments are both 8-bit).

Why by hand: Inductor compiles torchao's arithmetic for one tensor into a reduction kernel
that writes both updated moments in fp32 (the block scales need their absmax first) and two
pointwise kernels that read them back to quantize them. At model=8b's shapes on an H200
(bench/optim8bit.py --model 8b --layers 8 --profile, 2.16B parameters, 2026-11-29) that step
took 40.8 ms of GPU time against fused AdamW's 17.2 ms: about 32 bytes moved per parameter,
and the quantizing kernels alone 26 ms. Here each program holds whole 256-element blocks in
registers: the parameter, its gradient and the two 8-bit moments are read once and written
once (16 bytes a parameter), the absmax is taken in registers, and nothing goes back to memory
in fp32.

What then bound it was the 256-entry code table: torchao finds a code by a binary search, 8
dependent reads per element and moment, and the L1 serves a gather one cache line at a time.
Each code is computed from its value here (`_code_guess`) and checked against the two table
values around it; with one block a program on one warp, the step at 8b's shapes takes 21.0 ms
against the binary search's 32.7 and fused AdamW's 17.2 (`python bench/optim8bit.py`,
raw outputs of 2026-11-30).

The arithmetic is torchao's (quant_utils: dequant_with_qmap, scale_tensor,
quantize_8bit_with_qmap; adam.single_param_adam), op for op, with the rounding Inductor's code
for them has: `/` (approximate on CUDA) and tl.sqrt_rn. IEEE division (tl.div_rn) made the
step 1.2x slower at 8b's shapes on an H200 (38.7 ms, against 32.1 with `/` and tl.sqrt) and
no closer to torchao's compiled step. The two compilations agree to fp32 rounding, and where
that rounding differs a code may round to its neighbour (tests/gpu). With TRITON_INTERPRET=1
it runs on CPU tensors in Triton's interpreter (the CPU test).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 256  # torchao's block size: one scale per 256 elements
# Blocks a program takes and its warps: one block and one warp (each thread 8 elements of each
# tensor in registers, the block's absmax a reduction within the warp). On an H200, one
# 14336 x 4096 tensor (bench/optim8bit_kernel_sweep.py, 2026-11-30): 1 x 1 took 0.56 ms, 8
# blocks on 8 warps 0.90.
ROWS = 1
WARPS = 1


@triton.jit
def _code_guess(x, SIGNED: tl.constexpr):
    """The largest code of torchao's dynamic map whose value is at most x, to within one,
    from x alone (torchao finds it by a binary search: 8 dependent table reads).

    The map (create_dynamic_map) holds in decade i = 0..6 n_i values
    10**(i-6) * (0.1 + (j + 0.5) * 0.9 / n_i), j < n_i, with n_i = 2**i a sign for exp_avg
    (SIGNED: negatives at 0..126, zero at 127, positives from 128) and 2**(i+1) for
    exp_avg_sq (zero at 0), and 1.0 last. A decade misjudged at its edge lands on the
    neighbouring code (the formula is continuous there); the fp32 rounding of the table and
    log2/exp2's approximation on the GPU move it by one at most."""
    a = tl.abs(x)
    e = tl.floor(tl.log2(a) * 0.30102999566398120) + 7.0  # log2(0) = -inf: clamped to 0
    e = tl.minimum(tl.maximum(e, 0.0), 6.0)
    frac = a * tl.exp2((6.0 - e) * 3.3219280948873623)  # a / 10**(e - 6), in [0.1, 1)
    n = (1 if SIGNED else 2) << e.to(tl.int32)
    first = (128 if SIGNED else 0) + n - 1  # the decade's first code
    j = tl.floor((frac - 0.1) * n.to(tl.float32) * (1 / 0.9) - 0.5)  # -1: the decade before
    j = tl.minimum(tl.maximum(j, -256.0), 256.0).to(tl.int32)  # no NaN or inf to cast
    code = tl.minimum(tl.maximum(first + j, 127 if SIGNED else 0), 255)
    if SIGNED:  # -a lies above the negative mirror of the positive code after a's
        code = tl.where(x < 0, 253 - code, code)
    return code


@triton.jit
def _quantize(x, qmap, guess):
    """torchao's quantize_8bit_with_qmap given `guess`, its first step's code to within one:
    that code checked against the two table values around it (and moved by one where it was
    off), then the nearer of it and the next (tests/test_optim8bit.py: torchao's codes, also
    from a guess one off either way)."""
    g = tl.minimum(tl.maximum(guess, 0), 254)
    at = tl.load(qmap + g)
    after = tl.load(qmap + g + 1)
    lower = (x < at) & (g > 0)
    higher = x >= after
    # Read only where the guess was off: the table reads bound the kernel (L1 serves a
    # gather one cache line at a time), and lanes masked off read nothing.
    below = tl.load(qmap + tl.maximum(g - 1, 0), mask=lower, other=0.0)
    beyond = tl.load(qmap + tl.minimum(g + 2, 255), mask=higher, other=0.0)
    codes = g - lower.to(tl.int32) + higher.to(tl.int32)
    down_val = tl.where(lower, below, tl.where(higher, after, at))
    up_val = tl.where(lower, at, tl.where(higher, beyond, after))
    up = tl.minimum(codes + 1, 255)
    codes = tl.where(x - down_val >= (up_val - down_val) * 0.5, up, codes)
    return tl.where(x == x, codes, 0)  # NaN: torchao's search ends at code 0


@triton.jit
def _moment(
    codes_ptr, scale_ptr, qmap, offs, rows, mask, row_mask, target, weight, SIGNED: tl.constexpr
):
    """One moment: dequantized, lerped toward `target` (torch.lerp's formula), scaled by its
    blocks' absmax and stored as codes and scales; returns the fp32 moment."""
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    old = tl.load(qmap + codes) * scale[:, None]
    if weight < 0.5:
        new = old + weight * (target - old)
    else:
        new = target - (target - old) * (1.0 - weight)
    absmax = tl.maximum(tl.max(tl.where(mask, tl.abs(new), 0.0), axis=1), 1e-12)
    scaled = new / absmax[:, None]
    q = _quantize(scaled, qmap, _code_guess(scaled, SIGNED))
    tl.store(codes_ptr + offs, q.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + rows, absmax, mask=row_mask)
    return new


@triton.jit
def _adamw8bit_kernel(
    p_ptr, g_ptr, m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, n_rows,
    lr, weight1, weight2, weight_decay, eps, bias_correction1, bias_correction2_sqrt,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = row_mask[:, None]
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p - lr * weight_decay * p
    m = _moment(m_codes, m_scale, m_qmap, offs, rows, mask, row_mask, g, weight1, True)
    v = _moment(v_codes, v_scale, v_qmap, offs, rows, mask, row_mask, g * g, weight2, False)
    denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
    p = p - lr * (m / bias_correction1) / denom
    tl.store(p_ptr + offs, p, mask=mask)


def adamw8bit_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    exp_avg_sq: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    step: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    rows: int = ROWS,
    num_warps: int = WARPS,
) -> None:
    """One AdamW step of fp32 `p` (contiguous) in place, its moments each (codes, scale,
    qmap) as torchao's OptimState8bit holds them; `step` (a CPU tensor, as torchao keeps it)
    counts this one. The bias corrections are torchao's fp32 ones, computed on the host."""
    n = p.numel()
    if n % BLOCK:
        raise ValueError(f"{n} elements is not a whole number of {BLOCK}-element blocks")
    n_rows = n // BLOCK
    grid = (triton.cdiv(n_rows, rows),)
    # The lerp weights as torchao passes them: 1 - beta in double, then one fp32 rounding
    # (1 - 0.9 is 0.1f so; in the kernel's fp32, 1 - 0.9f is 0.100000024).
    weight1, weight2 = 1 - beta1, 1 - beta2
    bias_correction1 = float(1 - beta1**step)
    bias_correction2_sqrt = float((1 - beta2**step).sqrt())
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        _adamw8bit_kernel[grid](
            p, grad, *exp_avg, *exp_avg_sq, n_rows,
            lr, weight1, weight2, weight_decay, eps,
            bias_correction1, bias_correction2_sqrt,
            ROWS=rows, BLOCK=BLOCK, num_warps=num_warps,
        )  # fmt: skip
