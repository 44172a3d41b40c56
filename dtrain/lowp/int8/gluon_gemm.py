"""precision=int8's forward and grad-input GEMM for Hopper in Gluon: persistent and
warp-specialized, so that one warpgroup's epilogue runs while the other's MMAs do.

    launch(a, b, a_scale, b_scale, out, tile=None): triton_gemm.int8_mm's computation and bits,
    a (M, K) int8 row-major, b (K, N) int8 column-major (both K-major, as int8 wgmma reads
    them), a_scale (M,) and b_scale (N,) fp32, into out (M, N) of a float dtype:
        out = float32(a @ b) * a_scale[:, None] * b_scale[None, :]
    the int32 sum exact, then the two fp32 multiplies in that order and one cast, as eager's
    `torch._int_mm(a, b) * sa * sb` rounds them. Where it applies (`applies`: Hopper, operands
    TMA reads, both scales); triton_gemm.int8_mm runs the Triton kernels elsewhere.

Why: the Triton persistent TMA kernel (triton_gemm._int8_mm_tma_kernel) runs at about 60% of
the int8 peak on 1b's shapes (1,170-1,220 TOP/s of 1,979 in raw outputs of 2026-12-02)
where cuBLAS runs bf16 at 62% and its fp8 GEMM 5-12% faster than it. Its eight warps compute
one tile together: at the end of each tile they all stop issuing MMAs to convert, scale and
store it, and at K = 2,048 (most of 1b's GEMMs: 16 steps of 128) that epilogue is a tenth of
the tile's time. Warp specialization, which hides it in Triton's persistent GEMMs, Triton
compiles for Blackwell only.

So here, as CUTLASS's ping-pong kernels: a producer warp issues the TMA loads of every tile
this program computes, in order, into a ring of NUM_BUFFERS shared-memory stages, and two
consumer warpgroups take the program's tiles in turn (consumer 0 its 1st, 3rd, ...; consumer 1
its 2nd, 4th, ...), each with a whole tile's int32 sums in its registers. A consumer starts a
tile once the other has issued the MMAs of the tile before (`turn` barriers, CUTLASS's order
barrier), so its epilogue (convert, scale, cast, store) runs while the other's MMAs do. Stages:
`ready` (count 1: the producer's expected bytes) and `empty` (count 1: the one consumer that
read it, once its wgmma is done; all start free). Each consumer keeps one wgmma in flight (waits
for the one before), which is the only overlap a self-chained accumulator allows.

Tiles (a consumer's BLOCK_M x BLOCK_N, BLOCK_K, stages) are timed on a shape's first call and
the fastest kept for it (`_tuned`), as Triton's autotuner does for the Triton kernels.
precision.int8_gemm=gluon chooses this kernel; compiled for sm_90a on CPU
in tests/test_int8_triton.py (Triton 3.6, which torch 2.11 ships, and 3.9): warp-specialized,
int8 wgmma on TMA stages, nothing spilled.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Gluon is experimental and renames: Triton 3.6 has tma.async_copy_global_to_shared, Triton 3.9
# async_load (where the old name raises).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# (BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUFFERS): a consumer's tile, the K step, the stages. A
# consumer holds BLOCK_M * BLOCK_N / 128 int32 sums a thread (128 at these tiles); shared memory
# is (BLOCK_M + BLOCK_N) * BLOCK_K bytes a stage (32 KiB for 128 x 128 x 128: 6 stages are 192).
TILES = [(128, 128, 128, 4), (128, 128, 128, 6), (128, 128, 64, 8)]
_GROUP_M = 8
# Registers a thread of each worker partition (setmaxnreg): the other consumer, the producer
# warp; the default partition (consumer 0) takes 256. With the grouped kernel's 232 and 40,
# Triton 3.9's code for the bf16 epilogue kept a 72-byte stack frame in the consumer; at 240 it
# keeps none (the compile test), and the producer's loop fits in the fewest registers, 24.
_WORKER_REGS = gl.constexpr([240, 24])
_CONSUMERS = gl.constexpr(2)


@gluon.jit
def _tile_offsets(
    tile_id, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr
):
    """(off_m, off_n) of the tile_id-th tile in grouped order (triton_gemm.grouped_tile's)."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    width = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = (tile_id // width) * GROUP_M
    rows_here = min(num_pid_m - first_m, GROUP_M)
    off_m = (first_m + (tile_id % width) % rows_here) * BLOCK_M
    off_n = ((tile_id % width) // rows_here) * BLOCK_N
    return off_m, off_n


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    """One warp: every K step of every tile of this program, in order, into stage
    step % NUM_BUFFERS once its last reader has released it (TMA fills past the edges with 0)."""
    NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    k_tiles = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    step = 0
    for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        for k in range(k_tiles):
            index = step % NUM_BUFFERS
            mbarrier.wait(empty.index(index), (step // NUM_BUFFERS) & 1)
            bar = ready.index(index)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [off_m, k * BLOCK_K], bar, a_bufs.index(index))
            _tma_load(b_desc, [off_n, k * BLOCK_K], bar, b_bufs.index(index))
            step += 1


@gluon.jit
def _consumer(
    INDEX: gl.constexpr,
    a_bufs,
    b_bufs,
    ready,
    empty,
    turn,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_cm,
    stride_cn,
    GROUP_M: gl.constexpr,
):
    """One warpgroup: this program's tiles INDEX, INDEX + 2, ... whole, each K step one wgmma
    chain on its stage (the one before waited for, then its stage released), then the
    epilogue."""
    NUM_BUFFERS: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )  # wgmma m64nNk32 (int8), BLOCK_M / 64 of them a K step of 32
    k_tiles = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, mma)
    # this consumer's i-th tile is the program's (2i + INDEX)-th: its steps start there
    step = INDEX * k_tiles
    i = 0
    for tile_id in range(pid + INDEX * programs, num_tiles, _CONSUMERS * programs):
        off_m, off_n = _tile_offsets(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # The other consumer has waited for every stage of the tile before this one. Only then
        # are this tile's `ready` phases the next ones of their barriers: a parity names a
        # phase only among the two nearest, and this tile's first step is k_tiles past the
        # other's first, more than NUM_BUFFERS at dtrain's K.
        mbarrier.wait(turn.index(INDEX), i & 1)
        for k in range(k_tiles):
            index = step % NUM_BUFFERS
            mbarrier.wait(ready.index(index), (step // NUM_BUFFERS) & 1)
            b = b_bufs.index(index).permute((1, 0))  # (BLOCK_K, BLOCK_N), K-major
            acc = warpgroup_mma(a_bufs.index(index), b, acc, use_acc=k > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the step before is done: its stage is free
            mbarrier.arrive(empty.index((step + NUM_BUFFERS - 1) % NUM_BUFFERS), pred=k > 0)
            step += 1
        mbarrier.arrive(turn.index(1 - INDEX))  # its turn: this tile's MMAs are all issued
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step + NUM_BUFFERS - 1) % NUM_BUFFERS))
        step += k_tiles  # past the other consumer's tile
        i += 1
        _dequantize_store(
            acc, c_ptr, a_scale_ptr, b_scale_ptr, off_m, off_n, M, N, stride_cm, stride_cn, mma
        )


@gluon.jit
def _dequantize_store(
    acc, c_ptr, a_scale_ptr, b_scale_ptr, off_m, off_n, M, N, stride_cm, stride_cn,
    mma: gl.constexpr,
):  # fmt: skip
    """triton_gemm.dequantize_store's epilogue: (float(acc) * sa) * sb, cast, the rows and
    columns inside (M, N) stored. 32-bit offsets: `applies` takes outputs under 2**31 values
    (64-bit ones cost the consumer a stack frame in ptxas)."""
    rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, mma))
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, mma))
    m_ok = rows < M
    n_ok = cols < N
    sa = gl.load(a_scale_ptr + rows, mask=m_ok, other=0.0)
    sb = gl.load(b_scale_ptr + cols, mask=n_ok, other=0.0)
    out = acc.to(gl.float32) * gl.expand_dims(sa, 1)
    out = out * gl.expand_dims(sb, 0)
    offs = gl.expand_dims(rows * stride_cm, 1) + gl.expand_dims(cols * stride_cn, 0)
    mask = gl.expand_dims(m_ok, 1) & gl.expand_dims(n_ok, 0)
    gl.store(c_ptr + offs, out.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _int8_mm_ws_kernel(
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
    GROUP_M: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]  # a's tiles are (BLOCK_M, BLOCK_K)
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]  # b's tiles are (BLOCK_N, BLOCK_K)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(gl.int8, [NUM_BUFFERS, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.int8, [NUM_BUFFERS, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
        mbarrier.arrive(empty.index(i), count=1)  # every stage starts free
    # turn[c]: consumer c may wait for its next tile's stages (phase i: its i-th tile), arrived
    # by the other once it has issued its own tile's MMAs; consumer 0 goes first
    turn = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.arrive(turn.index(0), count=1)
    common = (a_bufs, b_bufs, ready, empty, turn, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K)
    common += (stride_cm, stride_cn, GROUP_M)
    gl.warp_specialize(
        [
            (_consumer, (gl.constexpr(0),) + common),  # the default partition
            (_consumer, (gl.constexpr(1),) + common),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
        ],
        [4, 1],
        _WORKER_REGS,
    )


def descriptors(a: torch.Tensor, b: torch.Tensor, tile: tuple):
    """This kernel's TMA descriptors at `tile` (`k_major_descriptors`)."""
    block_m, block_n, block_k, _ = tile
    return k_major_descriptors(a, b, block_m, block_n, block_k)


def k_major_descriptors(a: torch.Tensor, b: torch.Tensor, block_m, block_n, block_k):
    """TMA descriptors of a (M, K) row-major and of b (K, N) column-major read as (N, K)
    row-major, boxes (block_m, block_k) and (block_n, block_k): both K-major, as int8 wgmma
    reads them (also grouped_gluon's)."""
    bt = b.t()
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.int8)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.int8)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [block_m, block_k], a_layout)
    b_desc = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [block_n, block_k], b_layout)
    return a_desc, b_desc


def applies(a, b, a_scale, b_scale, out_dtype) -> bool:
    """Whether this kernel can run the problem: on Hopper itself (sm_90's wgmma; Blackwell has
    none) with Gluon for it, operands TMA reads, both scales (training's forward and
    grad-input GEMMs; the unscaled integer product takes the Triton kernels), a float output of
    under 2**31 values (the epilogue's 32-bit offsets)."""
    from dtrain.lowp.int8.gluon_support import has_gluon_hopper
    from dtrain.lowp.int8.kernel_common import tma_ok

    return (
        a_scale is not None
        and b_scale is not None
        and out_dtype.is_floating_point
        and a.shape[0] * b.shape[1] < 2**31
        and a.is_cuda
        and torch.cuda.get_device_capability(a.device)[0] == 9
        and has_gluon_hopper()
        and tma_ok(a, b)
    )


def launch(a, b, a_scale, b_scale, out, tile: tuple | None = None) -> None:
    """The GEMM into `out` (`applies`) at `tile` (one of TILES), or at the one timed fastest
    for this problem (`_tuned`) when tile is None."""
    if tile is None:
        tile = _tuned(a, b, a_scale, b_scale, out)
    elif tuple(tile) not in TILES:  # each compiled without spills in the compile test
        raise ValueError(f"gluon_gemm.launch: tile {tile} is not one of {TILES}")
    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, _, buffers = tile
    a_desc, b_desc = descriptors(a, b, tile)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # one program an SM; each program's two consumers take its tiles in turn
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    with torch.cuda.device(a.device):
        _int8_mm_ws_kernel[(min(sms, tiles),)](
            a_desc, b_desc, out, a_scale, b_scale, m, n, k, out.stride(0), out.stride(1),
            GROUP_M=_GROUP_M, NUM_BUFFERS=buffers,
            num_warps=4,  # the default partition's: consumer 0
        )  # fmt: skip


# (M, N, K, out dtype, device) -> the tile timed fastest: the choice is per process
_CHOSEN: dict[tuple, tuple] = {}


def _tuned(a, b, a_scale, b_scale, out) -> tuple:
    """The fastest of TILES for this problem, timed once (triton_gemm's autotuning timer: a
    tile that fails to compile counts as infinitely slow). The sums are integers and the
    epilogue the same at every tile, so each writes the same bits: timing into `out` is
    harmless."""
    from dtrain.lowp.int8.kernel_common import median_ms

    key = (*a.shape, b.shape[1], out.dtype, a.device)
    if key not in _CHOSEN:
        times = {t: median_ms(partial(launch, a, b, a_scale, b_scale, out, t)) for t in TILES}
        _CHOSEN[key] = min(times, key=times.get)
    return _CHOSEN[key]


def chosen_tiles() -> dict:
    """{"(M, K, N, out dtype)": the tile chosen} so far in this process, for benchmarks' logs."""
    return {str(k[:-1]): list(v) for k, v in _CHOSEN.items()}
