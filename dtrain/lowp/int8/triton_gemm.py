"""Triton kernels for precision=int8 on Hopper: an int8 GEMM with the dequantization fused into
its epilogue, and a row-wise quantize (each row loaded once where it fits a tile, else twice).

`torch._int_mm` reaches Hopper's int8 tensor cores through CUTLASS's sm80 kernels (mma.sync);
Triton lowers an int8 `tl.dot` to wgmma on sm90 (MMAv3: int8 operands, int32 accumulation,
BLOCK_M a multiple of 64, BLOCK_K >= 32, 4 or 8 warps), which is what these kernels are for.

    int8_mm(a, b, a_scale, b_scale, out_dtype)
        a (M, K) int8, b (K, N) int8 given column-major (the transpose of an (N, K) row-major
        tensor: both operands K-major, the layout int8 wgmma reads), a_scale (M,) and b_scale
        (N,) fp32 or None. Returns (M, N) in out_dtype:
            out = float32(a @ b) * a_scale[:, None] * b_scale[None, :]
        the same fp32 operations, in the same order, as `torch._int_mm(a, b) * sa * sb` (so
        the result is bitwise equal to the eager path), without the int32 product ever
        reaching memory. out_dtype=int32 without scales returns the integer product itself.
        Two kernels compute it: a persistent one with TMA loads (large problems on a GPU whose
        operands have 16-byte-aligned rows; precision.int8_gemm) and one with pointer loads (the
        rest).
    quantize_rowwise(x, col_scale)
        x (R, C) float, any strides; col_scale (C,) fp32 or None multiplies x's columns first.
        Returns q (R, C) int8 row-major and scale (R, 1) fp32 with x ~ q * scale: the abs-max
        of each row / 127, then each value times the scale's reciprocal, rounded half to even
        and clamped to [-127, 127], in IEEE fp32 as `dtrain.lowp.int8.quantize_rowwise`
        computes them (bitwise equal results). On a GPU, rows contiguous in memory take the
        tile autotuning chooses per shape (QUANTIZE_TILES): one pass (the row one tile, loaded
        once) or two sweeps (loaded twice, the second mostly from L2).

Shapes: any M, N, K. Rows and columns past the edges are masked (loads wrap around inside
the tensor, stores are masked); a K that is not a multiple of BLOCK_K masks its last tile with
zeros, which add nothing to the dot products. Nothing is padded or copied. Strides need no
alignment: Triton specialises on 16-byte-aligned ones and takes narrower loads otherwise
(correct, slower: dtrain's shapes are all multiples of 128). Offsets are 64-bit, so tensors
larger than 2**31 elements are fine; K above int8.MAX_REDUCTION is chunked by the caller so the
int32 accumulator cannot overflow.

Both are `torch.library.custom_op`s (dtrain::int8_mm, dtrain::int8_quantize_rowwise) with fake
implementations: torch.compile keeps each as one opaque call in its graph (no graph break),
and autotuning happens at run time on the first call of each shape. With TRITON_INTERPRET=1
(set before this module is imported) the kernels run on CPU tensors in Triton's interpreter,
one fixed small configuration instead of autotuning (CPU tests).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from functools import partial

import torch
import triton
import triton.language as tl

from dtrain.lowp.int8.kernel_common import bench_or_skip, median_ms, tma_ok  # noqa: F401 - shared

try:  # Triton >= 3.0 dispatches libdevice per backend here
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older layouts
    from triton.language.extra.cuda import libdevice

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
QMAX = 127.0
# amax * fp32(1/127), as dtrain.lowp.int8.quantize_rowwise computes the scale (see INV_QMAX there).
INV_QMAX = tl.constexpr(1.0 / QMAX)

# --- the GEMM ---------------------------------------------------------------------------------

# Hopper-typical tiles (H100/H200: 228 KB of shared memory per SM, 64K registers). Shared memory
# per stage is (BLOCK_M + BLOCK_N) * BLOCK_K bytes; the int32 accumulator takes
# BLOCK_M * BLOCK_N / (32 * num_warps) registers per thread (128 for the big tiles).
# Every BLOCK_K divides 128, so `K % 128 == 0` says no config needs the K mask (EVEN_K).
# The three configs autotuning chose for all 15 GEMM shapes of model=1b and 8b (fwd,
# grad-input, grad-weight) out of eight candidates on an H200 (bench/results/2026-11-27-int8/
# int8_kernels.json, "autotuned": 8, 6 and 1 shapes); the other five won nowhere and cost a
# compile and a timing each per shape at a run's first step.
_BIG = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3),
    (128, 128, 64, 4, 5),
]
# Problems below this many multiply-adds (tests' odd shapes, tiny layers) get one config and no
# tuning: autotuning them would cost more compile time than it could ever save.
_SMALL_WORK = 2**30
_SMALL = (64, 64, 64, 4, 3)
_INTERPRET_CONFIG = (32, 32, 32, 4, 1)  # the interpreter runs tiles in numpy: keep them small
_GROUP_M = 8
# Which GEMM kernel int8_mm runs on large problems on a GPU: "tma" (the persistent kernel with
# TMA loads, the default: 1.03-1.28x the pointer kernel on the nine 1b shapes, 0.95-1.35x on
# the twelve 8b ones, on an H200: raw outputs of 2026-12-01), "pointer" (tiles
# loaded through pointers, one program per tile) or "gluon" (dtrain/lowp/int8/gluon_gemm.py:
# persistent and warp-specialized, one warpgroup's epilogue beside the other's MMAs, where it
# applies: Hopper, both scales, operands TMA reads; "tma" elsewhere) or "fastest" (per
# problem the faster of "gluon" and "tma", timed once where the Gluon kernel applies: the Gluon
# kernel was 1.09-1.17x the TMA one at K >= 5632 and 0.83-0.86x at K = 2048 on an H200,
# raw outputs of 2026-12-03; both write the same bits). precision.int8_gemm sets it
# (configure), once, where the layers are swapped: the ops take tensors only.
GEMM = "tma"


def gemm_config(bm: int, bn: int, bk: int, warps: int, stages: int, pre_hook=None) -> triton.Config:
    """A GEMM tile (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) as autotuning takes it
    (`pre_hook`: the TMA kernels', which sets the descriptors' boxes to the tile)."""
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": _GROUP_M},
        num_warps=warps,
        num_stages=stages,
        pre_hook=pre_hook,
    )


def small_work_pruner(small: triton.Config):
    """Autotuning's pruner for a GEMM whose configs include `small`: problems under
    _SMALL_WORK multiply-adds get `small` only (untimed), the others every config but it."""

    def prune(configs, named_args, **kwargs):
        is_small = named_args["M"] * named_args["N"] * named_args["K"] < _SMALL_WORK
        return [c for c in configs if (c is small) == is_small]

    return prune


_BIG_CONFIGS = [gemm_config(*c) for c in _BIG]
_SMALL_CONFIG = gemm_config(*_SMALL)


@triton.jit
def grouped_tile(
    tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr
):
    """(pid_m, pid_n) of the tile_id-th tile in grouped order: GROUP_M tile-rows share the same
    B columns while they are in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def dequantize_store(
    acc,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_cm,
    stride_cn,
    HAS_A_SCALE: tl.constexpr,
    HAS_B_SCALE: tl.constexpr,
):
    """The epilogue: dequantize in fp32 exactly as eager does, (float(acc) * sa) * sb, then cast
    and store the rows and columns inside (M, N)."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    if HAS_A_SCALE or HAS_B_SCALE:
        out = acc.to(tl.float32)
        if HAS_A_SCALE:
            sa = tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)
            out = out * sa[:, None]
        if HAS_B_SCALE:
            sb = tl.load(b_scale_ptr + offs_n, mask=n_ok, other=0.0)
            out = out * sb[None, :]
    else:
        out = acc
    c_ptrs = (
        c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    )
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def tile_pointers(
    a_ptr, b_ptr, M, N, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """This program's output tile (grouped order) for a pointer-load GEMM: its rows and columns
    (offs_m, offs_n), its rows as 64-bit offsets inside M, the K offsets and the first K step's
    operand pointers, a (BM, BK) and b (BK, BN)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/columns past the edge read row/column (i mod M) instead: always in bounds, no mask
    # in the loop; their results are dropped by the masked store.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    return offs_m, offs_n, rows, offs_k, a_ptrs, b_ptrs


@triton.jit
def load_k_tiles(a_ptrs, b_ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    """One K step's operand tiles; past K (k_left values left) zeros, which add nothing."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
    return a, b


@triton.jit
def _int8_mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_A_SCALE: tl.constexpr,
    HAS_B_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, _, offs_k, a_ptrs, b_ptrs = tile_pointers(
        a_ptr, b_ptr, M, N, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    )  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a, b = load_k_tiles(a_ptrs, b_ptrs, offs_k, K - k * BLOCK_K, EVEN_K)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    dequantize_store(
        acc,
        c_ptr,
        a_scale_ptr,
        b_scale_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_cm,
        stride_cn,
        HAS_A_SCALE,
        HAS_B_SCALE,
    )


TUNE_KWARGS: dict = {}
_TUNE_PARAMS = inspect.signature(triton.autotune).parameters
if "do_bench" in _TUNE_PARAMS:  # Triton >= 3.2
    TUNE_KWARGS["do_bench"] = bench_or_skip
if "cache_results" in _TUNE_PARAMS:  # the choice per shape kept on disk: a second run skips it
    TUNE_KWARGS["cache_results"] = True
_int8_mm_tuned = triton.autotune(
    configs=[*_BIG_CONFIGS, _SMALL_CONFIG],
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": small_work_pruner(_SMALL_CONFIG)},
    **TUNE_KWARGS,
)(_int8_mm_kernel)


def _launch_int8_mm(a, b, out, a_scale, b_scale, config: tuple | None = None) -> None:
    """Run the GEMM into `out`: autotuned, or with `config` = (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages) (tests check every tuned config; the interpreter uses a small one)."""
    m, k = a.shape
    n = b.shape[1]
    dummy = out  # an unused pointer argument when a scale is absent
    args = (
        a,
        b,
        out,
        a_scale if a_scale is not None else dummy,
        b_scale if b_scale is not None else dummy,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
    )
    flags = {
        "HAS_A_SCALE": a_scale is not None,
        "HAS_B_SCALE": b_scale is not None,
        "EVEN_K": k % 128 == 0,
    }
    if INTERPRET:
        config = _INTERPRET_CONFIG
    run_kernel(_int8_mm_kernel, _int8_mm_tuned, tile_grid(m, n), args, flags, config, a.device)


def tile_grid(m: int, n: int):
    """A GEMM's grid of one program per (BLOCK_M, BLOCK_N) output tile."""

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    return grid


def run_kernel(kernel, tuned, grid, args, flags, config: tuple | None, device) -> None:
    """kernel[grid](*args) with `config` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages),
    or the autotuned `tuned` when config is None, on `device` (CUDA, or the interpreter's CPU)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if config is None:
            tuned[grid](*args, **flags)
            return
        bm, bn, bk, warps, stages = config
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": _GROUP_M}
        kernel[grid(meta)](*args, **flags, **meta, num_warps=warps, num_stages=stages)


# --- the GEMM, persistent with TMA loads (Hopper) -----------------------------------------------

# The same GEMM and epilogue, as a persistent kernel (one program per SM walking the tiles in the
# grouped order) whose operand tiles come in through Hopper's tensor memory accelerator (TMA:
# host-built descriptors, out-of-bounds reads filled with zeros, so no masks and no wrap-around).
# TMA needs 16-byte-aligned bases and row strides (K % 16 == 0 for int8 rows): other operands
# take the pointer kernel above.
_TMA_TILES = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). The first two, BLOCK_K 128 with 3
    # stages, are the fastest at 1b's and 8b's shapes, but their epilogue's staging in shared
    # memory comes on top of the operand stages: 128x256 with a 4-byte output (fp32 or int32)
    # needs 278,552 bytes, over the H200's 232,448, and 256x128 with an unscaled int32 one
    # (it fits with fp32: raw outputs of 2026-12-01). Autotuning
    # times such a config as infinite (`bench_or_skip`) and picks among the rest; with bf16
    # outputs, what training's forward writes, both fit. Leaving them out (f3595b7) made 17 of
    # the 21 1b and 8b GEMMs 11-23% slower (raw outputs of 2026-12-01: w2's forward
    # at 1b 0.364 against 0.306 ms, one call).
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 128, 8, 4),
    # The pointer kernel's pick for 8b's w2, where the four above were 3-5% slower than it.
    (128, 128, 64, 4, 5),
]


def tma_pre_hook(nargs):
    # Autotuning tries several tiles with the same descriptors: each config sets its own boxes.
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


_TMA_CONFIGS = [gemm_config(*t, pre_hook=tma_pre_hook) for t in _TMA_TILES]


@triton.jit
def _int8_mm_tma_kernel(
    a_desc,
    b_desc,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_cm,
    stride_cn,
    HAS_A_SCALE: tl.constexpr,
    HAS_B_SCALE: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    start_pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])  # (BM, BK)
            b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])  # (BN, BK): K-major
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        dequantize_store(
            acc,
            c_ptr,
            a_scale_ptr,
            b_scale_ptr,
            offs_m,
            offs_n,
            M,
            N,
            stride_cm,
            stride_cn,
            HAS_A_SCALE,
            HAS_B_SCALE,
        )


_int8_mm_tma_tuned = triton.autotune(configs=_TMA_CONFIGS, key=["M", "N", "K"], **TUNE_KWARGS)(
    _int8_mm_tma_kernel
)


def chosen_configs(**tuned) -> dict:
    """{name: {autotuning's key (shape, dtypes...): the config it chose}} so far in this process,
    for each autotuned kernel given by name."""
    return {
        name: {k: str(v) for k, v in getattr(kernel, "cache", {}).items()}
        for name, kernel in tuned.items()
    }


def tuned_configs() -> dict:
    """{"pointer" or "tma": {(M, N, K, dtypes...): the config autotuning chose}, "quantize":
    {(R, C, has column scales, dtypes...): the quantize's}} so far."""
    return chosen_configs(
        pointer=_int8_mm_tuned, tma=_int8_mm_tma_tuned, quantize=_quantize_rowwise_tuned
    )


def _has_tma(device: torch.device) -> bool:
    """Compute capability 9.0+ (Hopper): the GPUs with a tensor memory accelerator. The Triton
    kernels can be forced onto older GPUs (precision.int8_kernel=triton), where only the pointer
    kernel compiles."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def takes_tma(a, b) -> bool:
    """Whether int8_mm runs the persistent TMA kernel: GEMM says so, a large problem on a GPU
    with TMA, operands TMA can read."""
    m, k = a.shape
    return (
        GEMM in ("tma", "gluon", "fastest")
        and a.is_cuda
        and m * b.shape[1] * k >= _SMALL_WORK
        and _has_tma(a.device)
        and tma_ok(a, b)
    )


def _takes_gluon(a, b, a_scale, b_scale, out_dtype) -> bool:
    """Whether int8_mm may run the Gluon kernel: GEMM says "gluon" or "fastest", a large
    problem, and it applies (gluon_gemm.applies: Hopper with Gluon, both scales, operands
    TMA reads)."""
    if GEMM not in ("gluon", "fastest") or not a.is_cuda:
        return False
    if a.shape[0] * b.shape[1] * a.shape[1] < _SMALL_WORK:
        return False
    from dtrain.lowp.int8 import gluon_gemm

    return gluon_gemm.applies(a, b, a_scale, b_scale, out_dtype)


# GEMM="fastest": (M, K, N, out dtype, device) -> whether the Gluon kernel was the faster
_GLUON_FASTER: dict[tuple, bool] = {}


def _gluon_is_faster(a, b, a_scale, b_scale, out) -> bool:
    """Whether the Gluon kernel (at its own tuned tile) beat the TMA one (autotuned) on this
    problem, timed once per process with autotuning's timer after each has chosen its tile.
    Both compute integer sums and the same epilogue, so timing into `out` is harmless and the
    choice changes no bit."""
    from dtrain.lowp.int8 import gluon_gemm

    key = (*a.shape, b.shape[1], out.dtype, a.device)
    if key not in _GLUON_FASTER:
        tma = partial(_launch_int8_mm_tma, a, b, out, a_scale, b_scale)
        gluon = partial(gluon_gemm.launch, a, b, a_scale, b_scale, out)
        tma(), gluon()  # each tunes its tile first, outside the timing
        _GLUON_FASTER[key] = median_ms(gluon) < median_ms(tma)
    return _GLUON_FASTER[key]


def tma_operands(a, b, config: tuple | None = None):
    """(a_desc, b_desc, SMs) for a persistent TMA GEMM of a (M, K) row-major and b (K, N)
    column-major (`tma_ok`): the descriptors' boxes are set per config by `tma_pre_hook`
    (autotuning calls it), or here for a fixed `config` (BLOCK_M, BLOCK_N, BLOCK_K, ...)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    n = b.shape[1]
    bt = b.t()  # (N, K) row-major
    box = [1, 16]  # a placeholder: tma_pre_hook sets each config's boxes
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], box)
    b_desc = TensorDescriptor(bt, [n, k], [bt.stride(0), 1], box)
    if config is not None:  # a fixed config runs without the autotuner that calls the hook
        tiles = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), config[:3], strict=True))
        tma_pre_hook({"a_desc": a_desc, "b_desc": b_desc, **tiles})
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    return a_desc, b_desc, sms


def persistent_grid(m: int, n: int, sms: int):
    """A persistent kernel's grid: one program per SM, or one per tile when there are fewer."""

    def grid(meta):
        return (min(sms, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)

    return grid


def _launch_int8_mm_tma(a, b, out, a_scale, b_scale, config: tuple | None = None) -> None:
    """The persistent TMA GEMM into `out` (operands `tma_ok`); `config` as `_launch_int8_mm`."""
    m, k = a.shape
    n = b.shape[1]
    a_desc, b_desc, sms = tma_operands(a, b, config)
    dummy = out
    args = (
        a_desc,
        b_desc,
        out,
        a_scale if a_scale is not None else dummy,
        b_scale if b_scale is not None else dummy,
        m,
        n,
        k,
        out.stride(0),
        out.stride(1),
    )
    flags = {"HAS_A_SCALE": a_scale is not None, "HAS_B_SCALE": b_scale is not None, "NUM_SMS": sms}
    grid = persistent_grid(m, n, sms)
    run_kernel(_int8_mm_tma_kernel, _int8_mm_tma_tuned, grid, args, flags, config, a.device)


def _check_mm(a, b, a_scale, b_scale, out_dtype) -> None:
    if a.dtype != torch.int8 or b.dtype != torch.int8 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"int8_mm takes 2-d int8 operands, got {a.dtype} {a.shape}, {b.dtype} {b.shape}"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"int8_mm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    if out_dtype == torch.int32 and (a_scale is not None or b_scale is not None):
        raise ValueError("int8_mm: out_dtype=int32 is the integer product, without scales")
    for s, n, name in ((a_scale, a.shape[0], "a_scale"), (b_scale, b.shape[1], "b_scale")):
        if s is not None and (s.dtype != torch.float32 or s.numel() != n):
            raise ValueError(
                f"int8_mm: {name} must be {n} fp32 values, got {s.dtype} {tuple(s.shape)}"
            )


@torch.library.custom_op(
    "dtrain::int8_mm",
    mutates_args=(),
    schema="(Tensor a, Tensor b, Tensor? a_scale, Tensor? b_scale, ScalarType out_dtype) -> Tensor",
)
def int8_mm(a, b, a_scale, b_scale, out_dtype):
    _check_mm(a, b, a_scale, b_scale, out_dtype)
    m, n = a.shape[0], b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    sa = a_scale.reshape(-1).contiguous() if a_scale is not None else None
    sb = b_scale.reshape(-1).contiguous() if b_scale is not None else None
    if _takes_gluon(a, b, sa, sb, out_dtype) and (
        GEMM == "gluon" or _gluon_is_faster(a, b, sa, sb, out)
    ):
        from dtrain.lowp.int8 import gluon_gemm  # Gluon: imported only where it runs

        gluon_gemm.launch(a, b, sa, sb, out)
    elif takes_tma(a, b):
        _launch_int8_mm_tma(a, b, out, sa, sb)
    else:
        _launch_int8_mm(a, b, out, sa, sb)
    return out


@int8_mm.register_fake
def _(a, b, a_scale, b_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


# --- the row-wise quantize --------------------------------------------------------------------

if INTERPRET:

    @triton.jit
    def _rint(x):
        # The interpreter has no libdevice. Adding 1.5 * 2**23 leaves no fraction bits in fp32,
        # so numpy's IEEE add rounds x half-to-even (|x| <= 127 here); subtracting is exact.
        return (x + 12582912.0) - 12582912.0

else:

    @triton.jit
    def _rint(x):
        return libdevice.rint(x)  # round half to even, as torch.round


@triton.jit
def row_block(R, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows: their indices, which of them exist, and 64-bit row numbers
    (offsets past 2**31 elements)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return offs_r, offs_r < R, offs_r.to(tl.int64)


@triton.jit
def row_scales(amax):
    """A row's scale from its abs-max, as int8.quantize_rowwise computes it."""
    return tl.maximum(amax, 1e-12) * tl.full(amax.shape, INV_QMAX, tl.float32)


@triton.jit
def quantize_values(v, scale):
    """v (BLOCK_R, BLOCK_C) fp32 over its rows' scales (BLOCK_R,): int8 values, as int8.codes
    computes them: v times the row's reciprocal (one IEEE division a row: Triton's `/` on fp32
    is the approximate div.full), rounded half to even and clamped."""
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    y = _rint(v * tl.broadcast_to(inv[:, None], v.shape))
    return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)


@triton.jit
def _load_row_tile(
    x_ptr, col_scale_ptr, rows, r_ok, offs_c, C, stride_xr, stride_xc, HAS_COL_SCALE
):
    """A (BLOCK_R, len(offs_c)) tile of x in fp32 (times the column scales), 0 where masked
    (no effect on the abs-max), and its mask. Tiles are 2-d, so rows that are strided in memory
    (x a transposed view: stride_xr == 1) still load coalesced along the rows."""
    c_ok = offs_c < C
    ok = r_ok[:, None] & c_ok[None, :]
    ptrs = x_ptr + rows[:, None] * stride_xr + offs_c.to(tl.int64)[None, :] * stride_xc
    v = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    if HAS_COL_SCALE:
        v = v * tl.load(col_scale_ptr + offs_c, mask=c_ok, other=0.0)[None, :]
    return v, ok


@triton.jit
def _quantize_rowwise_kernel(
    x_ptr,
    col_scale_ptr,
    q_ptr,
    scale_ptr,
    R,
    C,
    stride_xr,
    stride_xc,
    HAS_COL_SCALE: tl.constexpr,
    ROW_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SWEEP_C: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    # One program per BLOCK_R rows, in one of two ways (QUANTIZE_TILES): one pass, the row one
    # tile (ROW_C >= C) loaded once and quantized from registers; or two sweeps of SWEEP_C, the
    # abs-max over the row in the first, then a second load (mostly from L2) to round and store.
    offs_r, r_ok, rows = row_block(R, BLOCK_R)
    if ONE_PASS:
        offs_c = tl.arange(0, ROW_C)
        v, ok = _load_row_tile(
            x_ptr, col_scale_ptr, rows, r_ok, offs_c, C, stride_xr, stride_xc, HAS_COL_SCALE
        )
        scale = row_scales(tl.max(tl.abs(v), axis=1))
        tl.store(scale_ptr + offs_r, scale, mask=r_ok)
        tl.store(q_ptr + rows[:, None] * C + offs_c[None, :], quantize_values(v, scale), mask=ok)
    else:
        # Each thread keeps the abs-max of its own columns, reduced across the tile once after
        # the sweep: a reduction a tile would synchronize the program's warps every tile.
        amax = tl.zeros((BLOCK_R, SWEEP_C), dtype=tl.float32)
        for c0 in range(0, C, SWEEP_C):
            offs_c = c0 + tl.arange(0, SWEEP_C)
            v, ok = _load_row_tile(
                x_ptr, col_scale_ptr, rows, r_ok, offs_c, C, stride_xr, stride_xc, HAS_COL_SCALE
            )
            amax = tl.maximum(amax, tl.abs(v))
        scale = row_scales(tl.max(amax, axis=1))
        tl.store(scale_ptr + offs_r, scale, mask=r_ok)
        for c0 in range(0, C, SWEEP_C):
            offs_c = c0 + tl.arange(0, SWEEP_C)
            v, ok = _load_row_tile(
                x_ptr, col_scale_ptr, rows, r_ok, offs_c, C, stride_xr, stride_xc, HAS_COL_SCALE
            )
            q_ptrs = q_ptr + rows[:, None] * C + offs_c[None, :]
            tl.store(q_ptrs, quantize_values(v, scale), mask=ok)


def quantize_blocks(r: int, c: int, rows_contiguous: bool) -> tuple[int, int, int]:
    """(BLOCK_R, SWEEP_C, num_warps) of two sweeps: tiles of 4096 values, long along the
    contiguous axis."""
    if rows_contiguous:  # each row is contiguous: sweep along it
        block_c = min(triton.next_power_of_2(c), 2048)
        block_r = min(triton.next_power_of_2(r), max(1, 4096 // block_c))
    else:  # x is a transposed view: consecutive rows are adjacent in memory (16 rows: 32-64
        # contiguous bytes per column, and more programs than 32 would give a short R)
        block_r = min(triton.next_power_of_2(r), 16)
        block_c = min(triton.next_power_of_2(c), 256)
    warps = 8 if block_r * block_c >= 4096 else 4
    if INTERPRET:  # small tiles, so the tests' short rows take several sweeps
        block_r, block_c = min(block_r, 16), min(block_c, 64)
    return block_r, block_c, warps


def one_pass_blocks(r: int, c: int) -> tuple[int, int, int]:
    """(BLOCK_R, SWEEP_C (unused: 1), num_warps) of one pass: whole rows, as many as make 4096
    values a tile where there are that many, 8-16 values a thread."""
    row_c = triton.next_power_of_2(c)
    block_r = min(triton.next_power_of_2(r), max(1, 4096 // row_c))
    return block_r, 1, min(16, max(4, block_r * row_c // 512))


# Rows up to this many values a program (BLOCK_R x next_power_of_2(C)) may take one pass, the
# row one tile kept in registers. Past it the fused SwiGLU's backward spills or fills the
# register file: at 16,384 (8b's 14,336) ptxas (sm_90a, Triton 3.6) takes 255 registers a
# thread at 8 warps and 128 at 16, the whole file for one program a multiprocessor, and at 32
# spills (Triton 3.9 spills at 8 warps too); at 8,192 it spills nothing and leaves room for
# two programs (tests/test_int8_triton.py compiles every tile offered and checks).
ONE_PASS_MAX = 8192


def row_tile_configs(tiles) -> list:
    """Autotuning configs of a row kernel from (ONE_PASS, BLOCK_R, SWEEP_C, num_warps) tiles."""
    return [
        triton.Config({"ONE_PASS": one, "BLOCK_R": br, "SWEEP_C": sc}, num_warps=w)
        for one, br, sc, w in tiles
    ]


def prune_row_tiles(configs, named_args, **kwargs):
    """One pass only where BLOCK_R rows of ROW_C = next_power_of_2(C) values are at most
    ONE_PASS_MAX; the sweeps only for rows longer than a sweep."""
    row_c = kwargs["ROW_C"]
    return [
        c
        for c in configs
        if (
            c.kwargs["BLOCK_R"] * row_c <= ONE_PASS_MAX
            if c.kwargs["ONE_PASS"]
            else c.kwargs["SWEEP_C"] < row_c
        )
    ]


def launch_rows(
    kernel, tuned, r: int, c: int, device, args, one_pass=None, rows_contiguous=True, consts=None
):
    """Runs a row kernel (ROW_C, BLOCK_R, SWEEP_C and ONE_PASS its last constants) over r rows
    of c values, `args` its arguments before those and `consts` its other constants by name:
    `tuned` (autotuned) on a GPU for rows contiguous in memory when one_pass is None, else a
    fixed tile, of one pass if `one_pass` (when None: for contiguous rows of up to
    ONE_PASS_MAX values) or of two sweeps."""
    consts = consts or {}
    row_c = triton.next_power_of_2(c)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if one_pass is None and rows_contiguous and not INTERPRET:
            grid = lambda meta: (triton.cdiv(r, meta["BLOCK_R"]),)  # noqa: E731
            tuned[grid](*args, **consts, ROW_C=row_c)
            return
        if one_pass is None:  # the interpreter, or rows strided in memory
            one_pass = rows_contiguous and row_c <= ONE_PASS_MAX
        block_r, sweep_c, warps = (
            one_pass_blocks(r, c) if one_pass else quantize_blocks(r, c, rows_contiguous)
        )
        kernel[(triton.cdiv(r, block_r),)](
            *args,
            **consts,
            ROW_C=row_c,
            BLOCK_R=block_r,
            SWEEP_C=sweep_c,
            ONE_PASS=one_pass,
            num_warps=warps,
        )


def tuned_rows(kernel, configs, key: list[str]):
    """`kernel` autotuned per `key` among `configs`, pruned by prune_row_tiles."""
    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": prune_row_tiles},
        **TUNE_KWARGS,
    )(kernel)


# (ONE_PASS, BLOCK_R, SWEEP_C, num_warps) autotuning chooses among per (R, C) for rows that are
# contiguous in memory (transposed views take quantize_blocks' fixed tile). With two sweeps of a
# 2 x 2,048 tile at 8 warps as its only tile, a 1b trace (`bash bench/lowp.sh profile1b`) put
# this kernel at 14.0 ms a step (dy's quantizes, every layer). Timed
# alone (bench/results/2026-11-27-int8), it quantized 1b's 16,384 x 2,048 bf16 activations in
# 0.075 ms where Inductor's persistent reduction, which loads each row once, took 0.053; one
# pass here does the same. Registers a thread for sm_90a with bf16 rows (ptxas, none spilled,
# tests/test_int8_triton.py): one pass of 2,048 at 4/8/16 warps 32/25/22 (2 x 2,048 at 8: 32),
# of 8,192 at 4/8/16 warps 89/48/32; sweeps 30-40.
QUANTIZE_TILES = [
    (True, 1, 1, 4),
    (True, 2, 1, 8),
    (True, 1, 1, 8),
    (True, 1, 1, 16),
    (False, 2, 2048, 8),
    (False, 1, 2048, 8),
]
_quantize_rowwise_tuned = tuned_rows(
    _quantize_rowwise_kernel, row_tile_configs(QUANTIZE_TILES), ["R", "C", "HAS_COL_SCALE"]
)
# precision.int8_quantize_tiles=sweeps keeps the op on two sweeps of quantize_blocks' fixed tile.
QUANTIZE_TILE = "tuned"


def configure(*, gemm: str, quantize_tiles: str) -> None:
    """The run's precision.int8_gemm and int8_quantize_tiles, for the ops to read."""
    global GEMM, QUANTIZE_TILE
    GEMM, QUANTIZE_TILE = gemm, quantize_tiles


def quantize_rows(x, col_scale=None, *, one_pass: bool | None = None):
    """quantize_rowwise's computation. On a GPU, rows contiguous in memory are autotuned among
    QUANTIZE_TILES; `one_pass` (True or False) forces one pass or two sweeps with a fixed tile
    (tests and benchmarks), as precision.int8_quantize_tiles=sweeps does for the sweeps;
    transposed views and the interpreter take a fixed tile too (launch_rows)."""
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_rowwise takes a 2-d float tensor, got {x.dtype} {x.shape}")
    r, c = x.shape
    q = torch.empty((r, c), dtype=torch.int8, device=x.device)
    scale = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    if r == 0:
        return q, scale
    if c == 0:
        return q, scale.fill_(1e-12).mul_(INV_QMAX.value)  # the kernel's figure for amax 0
    cs = col_scale.reshape(-1).float().contiguous() if col_scale is not None else None
    if cs is not None and cs.numel() != c:
        raise ValueError(f"quantize_rowwise: col_scale has {cs.numel()} values for {c} columns")
    rows_contiguous = x.stride(1) == 1 or c == 1 or x.stride(0) != 1
    if one_pass is None and QUANTIZE_TILE == "sweeps":
        one_pass = False
    args = (x, cs if cs is not None else scale, q, scale, r, c, x.stride(0), x.stride(1))
    kernel, tuned = _quantize_rowwise_kernel, _quantize_rowwise_tuned
    consts = {"HAS_COL_SCALE": cs is not None}
    launch_rows(kernel, tuned, r, c, x.device, args, one_pass, rows_contiguous, consts)
    return q, scale


@torch.library.custom_op(
    "dtrain::int8_quantize_rowwise",
    mutates_args=(),
    schema="(Tensor x, Tensor? col_scale) -> (Tensor, Tensor)",
)
def quantize_rowwise(x, col_scale):
    return quantize_rows(x, col_scale)


@quantize_rowwise.register_fake
def _(x, col_scale):
    r, c = x.shape
    return x.new_empty((r, c), dtype=torch.int8), x.new_empty((r, 1), dtype=torch.float32)
