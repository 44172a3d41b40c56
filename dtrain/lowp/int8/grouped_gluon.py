"""int8_grouped's GEMM for Hopper in Gluon, warp-specialized so that one warpgroup's promotion
runs while the other's MMA does.

    launch(a, b, a_scale, out): the Triton kernels' computation and bits (dtrain/lowp/
    int8/grouped_triton.py: a (M, K) int8 row-major, b (K, N) int8 column-major, a_scale
    (M, groups) fp32; out (M, N) = the sum over the groups j, in order, of
    float32(a[:, j] @ b[j]) * a_scale[:, j], each group's scale-and-add one fused
    multiply-add in fp32), for operands TMA can read.

Why: the Triton kernel ran at cuBLAS bf16's speed on an H200 (0.86-1.00x, raw
outputs of 2026-12-02). Each K step of its 8 warps waits for the group's wgmma, promotes the int32
sum (convert, scale, add), and only then issues the next; a CTA-wide barrier keeps its two
warpgroups in step, so the tensor cores idle during every promotion. Waiting for fewer wgmmas
in one warpgroup does not help: ptxas serialises every wgmma when other instructions read an
accumulator while one is in flight (its note C7514; docs/precision.md).

So here the warps are split (Gluon's `warp_specialize`) into partitions that share only
mbarriers: two consumer warpgroups, each on one 64-row half of a 128-row output tile, and one
producer warp issuing the TMA loads into
NUM_BUFFERS shared-memory stages. A consumer's step is four chained wgmmas over one group and
128 columns (a 256-wide tile takes two steps a group), a wait for them, and the promotion;
after a group's last step it releases the stage. The consumers take turns issuing (`turn`
barriers, as CUTLASS's ping-pong orders its math warpgroups, here per step): consumer 0 issues
step j's wgmmas, then consumer 1 its own, which the tensor cores run after consumer 0's, so
consumer 0 promotes step j while consumer 1's MMAs run and consumer 1 promotes while consumer
0's step j + 1 runs. Stages: `ready` (count 1: the producer's expected bytes) and `empty` (one
arrive per consumer, after its wgmmas have read the stage; all start free).

Measured on an H200 (raw outputs of 2026-12-02): bit for bit the portable path at every
tile; on model=1b's and 8b's grad-weights 1.08-1.38x cuBLAS's bf16 and 1.27-1.81x the Triton
kernel (the 256-wide tile, 4 stages: 0.424 ms for 1b's w1 against 0.574 and 0.591), 830-930
TOP/s where the default int8 GEMM (one int32 sum) runs at 1,150-1,240. The exact magic-number
int32-to-fp32 conversion in place of cvt was 8-12% slower here; the promotion as one
fused multiply-add (two instructions a value instead of a multiply and an add rounded apart,
three) 7-11% faster at every 1b and 8b grad-weight (raw outputs of 2026-12-02), so it is the
arithmetic here and in the portable path; three consumers on 192 rows (each promotion hidden
behind two others' MMAs) were slower at every grad-weight (1b w1 0.441 ms against 0.426): the
promotion is bound by issuing instructions, not by its latency or cvt's rate. Compiled for
sm_90a on CPU in tests/test_int8_triton.py (Triton 3.6, which torch 2.11 ships, and 3.9): wgmmas
chained four to a wait in each consumer, nothing spilled. It runs wherever it applies
(grouped_triton.gluon_applies: Hopper, operands TMA reads, a Triton with Gluon for
Hopper), unless precision.int8_grouped_gemm=triton.
"""

from __future__ import annotations

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

from dtrain.lowp.int8.gluon_gemm import k_major_descriptors
from dtrain.lowp.int8.quant import GROUP

# Gluon is experimental and renames: Triton 3.6 has tma.async_copy_global_to_shared, Triton 3.9
# async_load (where the old name raises).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# (BLOCK_M, BLOCK_N, NUM_BUFFERS), the first the one training runs. BLOCK_M is 64 rows for each
# of the two consumer warpgroups, BLOCK_K the group. A consumer holds its fp32
# sums (64 registers a thread per 128 columns) and one step's int32 sum of 128 columns (64): at
# BLOCK_N 256 it takes a group in two steps, as the int32 sums of 256 columns would not fit
# beside the fp32 ones in the 232 registers a consumer is given. (BLOCK_M + BLOCK_N) * 128 bytes
# of shared memory a stage. 128 x 256 with 4 stages was the fastest at each of 1b's and 8b's
# grad-weights, 8-10% faster than 128 wide (the B tile is read once for twice the outputs); 3
# stages within 2% (raw outputs of 2026-12-02).
TILES = [(128, 256, 4), (128, 256, 3), (128, 128, 4)]
_ROWS = gl.constexpr(64)  # a consumer warpgroup's rows: wgmma's M
_GROUP = gl.constexpr(GROUP)  # the kernels' K step
_CHUNK_N = gl.constexpr(128)  # a consumer's columns a step
_GROUP_M = 8
# Registers a thread of each worker partition (setmaxnreg): the other consumer, the producer.
# The launch caps a thread at 168 (65,536 over 384 threads: Triton pads the producer's warp to
# a warpgroup), setmaxnreg moves them to the consumers. Nothing spills (the compile test).
_WORKER_REGS = gl.constexpr([232, 40])
_CONSUMERS = gl.constexpr(2)  # warpgroups of 64 rows each, taking turns


@gluon.jit
def _promote_add(acc, part, s):
    # acc + float32(part) * s as one fused multiply-add, rounded once to nearest with no flush
    # to zero: the bits of the portable path (int8_grouped.grouped_int_mm, on fma_f32) and of
    # the Triton kernels (grouped_triton._scaled_add). PTX's explicit form: the compiler
    # neither splits it nor flushes it.
    return gl.inline_asm_elementwise(
        "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [part.to(gl.float32), s, acc],
        dtype=gl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_tiles):
    """One warp: group k's tiles of a (BLOCK_M, GROUP) and b (BLOCK_N, GROUP) into stage
    k % NUM_BUFFERS once both consumers have released it (TMA fills past the edges with 0)."""
    NUM_BUFFERS: gl.constexpr = b_bufs.shape[0]
    for k in range(k_tiles):
        index = k % NUM_BUFFERS
        mbarrier.wait(empty.index(index), (k // NUM_BUFFERS) & 1)
        bar = ready.index(index)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [off_m, k * _GROUP], bar, a_bufs.index(index))
        _tma_load(b_desc, [off_n, k * _GROUP], bar, b_bufs.index(index))


@gluon.jit
def _issue(a, b, zero, turn, INDEX: gl.constexpr, step):
    """This consumer's wgmmas of one step (a chunk of a group), when its turn comes; then the
    other consumer's turn. Step s of consumer 1 waits for phase s of turn[1]: arrived by
    consumer 0 after its step s; consumer 0's step s for turn[0], arrived by consumer 1 after
    its step s - 1."""
    mbarrier.wait(turn.index(INDEX), step & 1)
    part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index((INDEX + 1) % _CONSUMERS), count=1)
    return part


@gluon.jit
def _consumer(
    INDEX: gl.constexpr,
    a_bufs,
    b_bufs,
    ready,
    empty,
    turn,
    c_ptr,
    s_ptr,
    off_m,
    off_n,
    M,
    N,
    k_tiles,
    stride_cm,
    stride_cn,
    stride_sm,
    stride_sg,
):
    """One warpgroup: rows off_m + 64 * INDEX onwards of the tile, group by group, each group in
    CHUNKS steps of _CHUNK_N columns (a BLOCK_N of 256 is two: its int32 sums would not fit
    beside its fp32 ones in one step)."""
    NUM_BUFFERS: gl.constexpr = b_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    CHUNK_N: gl.constexpr = _CHUNK_N if BLOCK_N > _CHUNK_N else BLOCK_N
    CHUNKS: gl.constexpr = BLOCK_N // CHUNK_N
    gl.static_assert(CHUNKS <= 2, "BLOCK_N at most two chunks")
    ROWS: gl.constexpr = _ROWS
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, CHUNK_N, 32]
    )  # wgmma m64nNk32 (int8)
    rows = off_m + INDEX * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    s_ptrs = s_ptr + (rows % M).to(gl.int64) * stride_sm  # rows past M: one inside, not stored
    zero = gl.zeros([ROWS, CHUNK_N], gl.int32, mma)
    acc0 = gl.zeros([ROWS, CHUNK_N], gl.float32, mma)
    acc1 = gl.zeros([ROWS, CHUNK_N], gl.float32, mma)  # CHUNKS == 2 only (else dead)
    for k in range(k_tiles):
        index = k % NUM_BUFFERS
        mbarrier.wait(ready.index(index), (k // NUM_BUFFERS) & 1)
        a = a_bufs.index(index).slice(INDEX * ROWS, ROWS)  # (64, GROUP): this consumer's half
        b = b_bufs.index(index)  # (BLOCK_N, GROUP): its chunks transposed are K-major
        b0 = b.slice(0, CHUNK_N).permute((1, 0))
        part = _issue(a, b0, zero, turn, INDEX, k * CHUNKS)
        s = gl.expand_dims(gl.load(s_ptrs + k * stride_sg), 1)  # while the wgmmas run
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        if CHUNKS == 1:
            mbarrier.arrive(empty.index(index), count=1)  # this consumer is done with the stage
        acc0 = _promote_add(acc0, part, s)
        if CHUNKS == 2:
            b1 = b.slice(CHUNK_N, CHUNK_N).permute((1, 0))
            part = _issue(a, b1, zero, turn, INDEX, k * CHUNKS + 1)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(index), count=1)
            acc1 = _promote_add(acc1, part, s)
    _store(acc0, c_ptr, rows, off_n, M, N, stride_cm, stride_cn, mma)
    if CHUNKS == 2:
        _store(acc1, c_ptr, rows, off_n + CHUNK_N, M, N, stride_cm, stride_cn, mma)


@gluon.jit
def _store(acc, c_ptr, rows, off_n, M, N, stride_cm, stride_cn, mma: gl.constexpr):
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, mma))
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    offs = gl.expand_dims(rows.to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols * stride_cn, 0)
    gl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _int8_mm_grouped_kernel(
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
    GROUP_M: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]  # a's tiles are (BLOCK_M, GROUP)
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]  # b's tiles are (BLOCK_N, GROUP)
    gl.static_assert(BLOCK_M == _CONSUMERS * _ROWS, "64 rows a consumer")
    gl.static_assert(a_desc.block_type.shape[1] == _GROUP, "each K step one group")

    # the output tile, grouped in GROUP_M rows of tiles (triton_gemm.grouped_tile's order)
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    width = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = (pid // width) * GROUP_M
    rows_here = min(num_pid_m - first_m, GROUP_M)
    off_m = (first_m + (pid % width) % rows_here) * BLOCK_M
    off_n = ((pid % width) // rows_here) * BLOCK_N

    a_bufs = gl.allocate_shared_memory(gl.int8, [NUM_BUFFERS, BLOCK_M, _GROUP], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.int8, [NUM_BUFFERS, BLOCK_N, _GROUP], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=_CONSUMERS)  # one arrive from each consumer
        mbarrier.arrive(empty.index(i), count=_CONSUMERS)  # every stage starts free
    # turn[c]: consumer c may issue its next step's wgmmas (phase s: its step s), arrived by the
    # other once that has issued; consumer 0 goes first
    turn = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.arrive(turn.index(0), count=1)

    k_tiles = gl.cdiv(K, _GROUP)
    common = (a_bufs, b_bufs, ready, empty, turn, c_ptr, s_ptr, off_m, off_n, M, N, k_tiles)
    common += (stride_cm, stride_cn, stride_sm, stride_sg)
    loads = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_tiles)
    gl.warp_specialize(
        [
            (_consumer, (gl.constexpr(0),) + common),  # the default partition
            (_consumer, (gl.constexpr(1),) + common),
            (_producer, loads),
        ],
        [4, 1],
        _WORKER_REGS,
    )


def descriptors(a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int):
    """TMA descriptors of a (M, K) row-major and of b (K, N) column-major read as (N, K)
    row-major: boxes (block_m, GROUP) and (block_n, GROUP), both K-major as int8 wgmma reads."""
    return k_major_descriptors(a, b, block_m, block_n, GROUP)


def launch(a, b, a_scale, out, tile: tuple = TILES[0]) -> None:
    """The grouped GEMM into `out` with `tile` = (BLOCK_M, BLOCK_N, NUM_BUFFERS)."""
    if tuple(tile) not in TILES:  # each compiled without spills in the compile test
        raise ValueError(f"grouped_gluon.launch: tile {tile} is not one of {TILES}")
    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, buffers = tile
    a_desc, b_desc = descriptors(a, b, block_m, block_n)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    with torch.cuda.device(a.device):
        _int8_mm_grouped_kernel[grid](
            a_desc, b_desc, out, a_scale, m, n, k, out.stride(0), out.stride(1),
            a_scale.stride(0), a_scale.stride(1), GROUP_M=_GROUP_M, NUM_BUFFERS=buffers,
            num_warps=4,  # the default partition's: consumer 0
        )  # fmt: skip
