"""The Triton kernels of precision=int8's grouped grad-weight (dtrain/lowp/int8/grouped.py): its
GEMM, and the quantize of its output gradient.

    int8_mm_grouped(a, b, a_scale, out_dtype)
        a (N, M) int8 with its rows' elements contiguous, b (M, K) int8 column-major (both
        K-major, as Hopper's int8 wgmma reads them), a_scale (N, ceil(M / 128)) fp32: one scale
        per row of a per 128 consecutive elements of the reduction. Returns (N, K) out_dtype:
            out = sum over j, in order, of float32(a[:, j] @ b[j]) * a_scale[:, j]
        with j the reduction's groups of 128. Each program's K loop takes one group a step:
        an int32 wgmma product of the group, promoted to fp32, scaled per row and added to an
        fp32 accumulator, so no int32 sum spans two scales and nothing reaches memory but the
        result. Each group's scale-and-add is one fused multiply-add, rounded once, as the
        portable `grouped_int_mm` computes it: the result is its bits.

    quantize_groups(g, token_scale) (the op dtrain::int8_quantize_groups)
        int8_grouped.quantize_groups in one pass, the same bits: g (M, N) times the per-token
        scales, quantized per column per 128 rows, the codes stored transposed (N, M) and the
        scales (N, groups) with a group's contiguous.

Tiles: BLOCK_K is the group (128). The two accumulators (int32 per group, fp32 across them)
take BLOCK_M * BLOCK_N / (16 * num_warps) registers a thread, so the tiles are at most 128 x 128
at 8 warps (triton_gemm's 128 x 256 would need 256). Two GEMM kernels, as triton_gemm has: one
loads through pointers (rows past an edge wrap around inside the tensor, their results not
stored; the last group masked with zeros, which add nothing), the other is persistent with TMA
loads (zeros past the edges), taken where triton_gemm's TMA GEMM is. With TRITON_INTERPRET=1
the pointer kernel and the quantize run on CPU tensors in Triton's interpreter, one small
configuration (CPU tests: tests/int8_triton_interp.py).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dtrain.lowp.int8.gluon_support import has_gluon_hopper
from dtrain.lowp.int8.quant import GROUP, group_count
from dtrain.lowp.int8.triton_gemm import (
    INTERPRET,
    TUNE_KWARGS,
    chosen_configs,
    dequantize_store,
    gemm_config,
    grouped_tile,
    load_k_tiles,
    persistent_grid,
    quantize_values,
    row_scales,
    run_kernel,
    small_work_pruner,
    takes_tma,
    tile_grid,
    tile_pointers,
    tma_ok,
    tma_operands,
    tma_pre_hook,
)

# The kernels index the scales by K step: each step must be one group.
_GROUP_K = tl.constexpr(GROUP)

# (BLOCK_M, BLOCK_N, BLOCK_K = GROUP, num_warps, num_stages): 32 KB of shared memory a stage at
# 128 x 128. On an H200 autotuning chose 128 x 128 at 8 warps for the persistent TMA kernel at
# every 1b and 8b grad-weight (raw outputs of 2026-12-02).
_TILES = [
    (128, 128, GROUP, 8, 3),
    (128, 128, GROUP, 8, 4),
    (64, 128, GROUP, 4, 4),
    (128, 64, GROUP, 4, 4),
]
_SMALL = (64, 64, GROUP, 4, 2)
_INTERPRET_CONFIG = (32, 32, GROUP, 4, 1)


_CONFIGS = [gemm_config(*t) for t in _TILES]
_SMALL_CONFIG = gemm_config(*_SMALL)


if INTERPRET:

    @triton.jit
    def _scaled_add(acc, part, s):
        return tl.fma(part, s, acc)  # the interpreter's fma rounds once (its fma_fp32)

else:

    @triton.jit
    def _scaled_add(acc, part, s):
        # acc + part * s as one fused multiply-add, rounded once, as the portable path's
        # fma_f32 and the Gluon kernel compute it. PTX's explicit fma.rn.f32: libdevice's and
        # tl.fma's forms may be compiled to flush-to-zero (.ftz), which eager's fp32 is not.
        # One rounding, two instructions a value where a multiply and an add rounded apart
        # take three: 7-11% faster in the Gluon kernel (raw outputs of 2026-12-02).
        s = tl.broadcast_to(s, part.shape)
        return tl.inline_asm_elementwise(
            "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [part, s, acc], dtype=tl.float32,
            is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def _int8_mm_grouped_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_sm,
    stride_sg,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K == _GROUP_K)
    offs_m, offs_n, rows, offs_k, a_ptrs, b_ptrs = tile_pointers(
        a_ptr, b_ptr, M, N, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    )  # fmt: skip
    s_ptrs = s_ptr + rows * stride_sm  # (BM,): the rows' scales of the group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, tl.cdiv(K, BLOCK_K)):
        a, b = load_k_tiles(a_ptrs, b_ptrs, offs_k, K - j * BLOCK_K, EVEN_K)
        part = tl.dot(a, b, out_dtype=tl.int32)  # this group's exact sum
        s = tl.load(s_ptrs + j * stride_sg)
        acc = _scaled_add(acc, part.to(tl.float32), s[:, None])
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    dequantize_store(  # no scales left: the fp32 sums cast and stored inside (M, N)
        acc, c_ptr, c_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, False, False
    )


_tuned = triton.autotune(
    configs=[*_CONFIGS, _SMALL_CONFIG],
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": small_work_pruner(_SMALL_CONFIG)},
    **TUNE_KWARGS,
)(_int8_mm_grouped_kernel)


# --- the same GEMM, persistent with TMA loads (Hopper) -------------------------------------------

# As triton_gemm's TMA GEMM: one program per SM walks the output tiles in grouped order, the
# operand tiles come in through Hopper's tensor memory accelerator (zeros past the edges, so a
# short last group needs no mask). Taken where triton_gemm's is (`takes_tma`: a large problem,
# operands TMA can read, precision.int8_gemm=tma); the pointer kernel above everywhere else.
_TMA_CONFIGS = [gemm_config(*t, pre_hook=tma_pre_hook) for t in _TILES]


@triton.jit
def _int8_mm_grouped_tma_kernel(
    a_desc,
    b_desc,
    c_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_cm,
    stride_cn,
    stride_sm,
    stride_sg,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K == _GROUP_K)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        s_ptrs = s_ptr + (offs_m % M).to(tl.int64) * stride_sm  # rows past M: one inside
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, j * BLOCK_K])  # (BM, BK)
            b = b_desc.load([pid_n * BLOCK_N, j * BLOCK_K])  # (BN, BK): K-major
            part = tl.dot(a, b.T, out_dtype=tl.int32)  # this group's exact sum
            s = tl.load(s_ptrs + j * stride_sg)
            acc = _scaled_add(acc, part.to(tl.float32), s[:, None])
        dequantize_store(  # no scales left: the fp32 sums cast and stored inside (M, N)
            acc, c_ptr, c_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, False, False
        )


_tma_tuned = triton.autotune(configs=_TMA_CONFIGS, key=["M", "N", "K"], **TUNE_KWARGS)(
    _int8_mm_grouped_tma_kernel
)


def launch_tma(a, b, a_scale, out, config: tuple | None = None) -> None:
    """The persistent TMA kernel into `out` (operands `takes_tma`); `config` as `launch`."""
    m, k = a.shape
    n = b.shape[1]
    a_desc, b_desc, sms = tma_operands(a, b, config)
    args = (a_desc, b_desc, out, a_scale, m, n, k, out.stride(0), out.stride(1))
    args += (a_scale.stride(0), a_scale.stride(1))
    grid = persistent_grid(m, n, sms)
    run_kernel(
        _int8_mm_grouped_tma_kernel, _tma_tuned, grid, args, {"NUM_SMS": sms}, config, a.device
    )


def launch(a, b, a_scale, out, config: tuple | None = None) -> None:
    """The grouped GEMM into `out`: autotuned, or with `config` = (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages) (tests run every tile autotuning may choose)."""
    m, k = a.shape
    n = b.shape[1]
    args = (
        a,
        b,
        out,
        a_scale,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        a_scale.stride(0),
        a_scale.stride(1),
    )
    if INTERPRET:
        config = _INTERPRET_CONFIG
    flags = {"EVEN_K": k % GROUP == 0}
    run_kernel(_int8_mm_grouped_kernel, _tuned, tile_grid(m, n), args, flags, config, a.device)


def tuned_configs() -> dict:
    """{"grouped" or "grouped_tma": {(M, N, K, dtypes...): the config autotuning chose}}."""
    return chosen_configs(grouped=_tuned, grouped_tma=_tma_tuned)


# --- the quantize of dy per output channel per 128 tokens ---------------------------------------

# Each program takes one group of tokens and BLOCK_N output channels: the (GROUP, BLOCK_N) tile
# of g * token_scale is loaded once, reduced over its tokens for each channel's scale, and its
# codes stored transposed, (N, M) with the tokens contiguous, as the GEMM reads them. Inductor's
# fusion of the torch ops instead writes the codes (M, N) and transposes them in a second
# kernel. Registers a thread for sm_90a with bf16 g (ptxas, none spilled, tests/
# test_int8_triton.py): see _QUANTIZE_TILES' test.
_QUANTIZE_TILES = [(32, 4), (64, 4), (64, 8), (128, 8)]  # (BLOCK_N, num_warps)
_QUANTIZE_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w) for bn, w in _QUANTIZE_TILES]
_INTERPRET_BLOCK_N = 16


@triton.jit
def _quantize_groups_kernel(
    g_ptr,
    ts_ptr,
    q_ptr,
    s_ptr,
    M,
    N,
    stride_gm,
    stride_gn,
    stride_qn,
    stride_sn,
    stride_sg,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows, cols = offs_m.to(tl.int64), offs_n.to(tl.int64)
    ok = m_ok[:, None] & n_ok[None, :]
    g = tl.load(g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn, mask=ok, other=0.0)
    ts = tl.load(ts_ptr + rows, mask=m_ok, other=0.0)
    # (BLOCK_N, GROUP): a channel's tokens along a row, so the scale is the row quantize's
    vt = tl.trans(g.to(tl.float32) * ts[:, None])
    scale = row_scales(tl.max(tl.abs(vt), axis=1))  # masked tokens: 0, no effect
    q = quantize_values(vt, scale)
    tl.store(
        q_ptr + cols[:, None] * stride_qn + rows[None, :], q, mask=n_ok[:, None] & m_ok[None, :]
    )
    tl.store(s_ptr + cols * stride_sn + tl.program_id(0) * stride_sg, scale, mask=n_ok)


_quantize_tuned = triton.autotune(configs=_QUANTIZE_CONFIGS, key=["M", "N"], **TUNE_KWARGS)(
    _quantize_groups_kernel
)


def quantize_groups(g, token_scale, block_n: int | None = None):
    """int8_grouped.quantize_groups' computation in one kernel, the same bits: gq (N, M) int8
    row-major and the scales (N, groups) fp32, strides (1, N). Autotuned on a GPU;
    `block_n` fixes the tile (tests; the interpreter uses a small one)."""
    if g.dim() != 2 or not g.dtype.is_floating_point:
        raise ValueError(
            f"quantize_groups takes a 2-d float tensor, got {g.dtype} {tuple(g.shape)}"
        )
    m, n = g.shape
    ts = token_scale.reshape(-1).float().contiguous()
    if ts.numel() != m:
        raise ValueError(f"quantize_groups: {ts.numel()} token scales for {m} tokens")
    groups = group_count(m)
    q = torch.empty((n, m), dtype=torch.int8, device=g.device)
    # (N, groups) with a group's scales contiguous: what the GEMM loads each K step
    scale = torch.empty_strided((n, groups), (1, n), dtype=torch.float32, device=g.device)
    if m == 0 or n == 0:
        return q, scale
    args = (g, ts, q, scale, m, n, g.stride(0), g.stride(1), q.stride(0), *scale.stride())
    if INTERPRET and block_n is None:
        block_n = _INTERPRET_BLOCK_N
    with torch.cuda.device(g.device) if g.is_cuda else contextlib.nullcontext():
        if block_n is None:
            grid = lambda meta: (groups, triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
            _quantize_tuned[grid](*args, GROUP_SIZE=GROUP)
        else:
            warps = dict(_QUANTIZE_TILES).get(block_n, 4)
            grid = (groups, triton.cdiv(n, block_n))
            _quantize_groups_kernel[grid](*args, GROUP_SIZE=GROUP, BLOCK_N=block_n, num_warps=warps)
    return q, scale


@torch.library.custom_op(
    "dtrain::int8_quantize_groups",
    mutates_args=(),
    schema="(Tensor g, Tensor token_scale) -> (Tensor, Tensor)",
)
def quantize_groups_op(g, token_scale):
    return quantize_groups(g, token_scale)


@quantize_groups_op.register_fake
def _(g, token_scale):
    m, n = g.shape
    groups = group_count(m)
    return g.new_empty((n, m), dtype=torch.int8), g.new_empty_strided(
        (n, groups), (1, n), dtype=torch.float32
    )


# Which kernel runs the grouped GEMM on Hopper: the Gluon one (dtrain/lowp/int8/grouped_gluon.py)
# where this Triton has Gluon for Hopper ("auto", the default) or always ("gluon"), or the Triton
# ones above ("triton"): precision.int8_grouped_gemm, set where the layers are swapped.
GROUPED_GEMM = "auto"


def gluon_applies(a, b) -> bool:
    """Whether the Gluon kernel can run these operands: on Hopper itself (its wgmma is sm_90's;
    Blackwell has none), operands TMA can read."""
    return a.is_cuda and torch.cuda.get_device_capability(a.device)[0] == 9 and tma_ok(a, b)


def configure(choice: str) -> None:
    """The run's precision.int8_grouped_gemm, for int8_mm_grouped to read."""
    global GROUPED_GEMM
    GROUPED_GEMM = choice


@contextlib.contextmanager
def grouped_gemm(choice: str):
    """int8_mm_grouped on `choice` (auto, gluon or triton) inside the block: for the
    benchmark's columns and the GPU check, which time or test each kernel through it."""
    global GROUPED_GEMM
    before, GROUPED_GEMM = GROUPED_GEMM, choice
    try:
        yield
    finally:
        GROUPED_GEMM = before


def _takes_gluon(a, b) -> bool:
    """The Gluon kernel: chosen (GROUPED_GEMM; "auto" where this Triton has it) and it applies."""
    if GROUPED_GEMM == "triton" or (GROUPED_GEMM == "auto" and not has_gluon_hopper()):
        return False
    return gluon_applies(a, b)


def _check(a, b, a_scale, out_dtype) -> None:
    if a.dtype != torch.int8 or b.dtype != torch.int8 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"int8_mm_grouped takes 2-d int8 operands, got {a.dtype} {tuple(a.shape)}, "
            f"{b.dtype} {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"int8_mm_grouped: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain"
        )
    groups = group_count(a.shape[1])
    if a_scale.dtype != torch.float32 or tuple(a_scale.shape) != (a.shape[0], groups):
        raise ValueError(
            f"int8_mm_grouped: a_scale must be fp32 of shape {(a.shape[0], groups)}, got "
            f"{a_scale.dtype} {tuple(a_scale.shape)}"
        )
    if not out_dtype.is_floating_point:
        raise ValueError(f"int8_mm_grouped: out_dtype must be a float dtype, got {out_dtype}")


@torch.library.custom_op(
    "dtrain::int8_mm_grouped",
    mutates_args=(),
    schema="(Tensor a, Tensor b, Tensor a_scale, ScalarType out_dtype) -> Tensor",
)
def int8_mm_grouped(a, b, a_scale, out_dtype):
    _check(a, b, a_scale, out_dtype)
    m, n = a.shape[0], b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    if _takes_gluon(a, b):
        from dtrain.lowp.int8 import grouped_gluon  # Gluon: imported only where it runs

        grouped_gluon.launch(a, b, a_scale, out)
    elif takes_tma(a, b):
        launch_tma(a, b, a_scale, out)
    else:
        launch(a, b, a_scale, out)
    return out


@int8_mm_grouped.register_fake
def _(a, b, a_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
