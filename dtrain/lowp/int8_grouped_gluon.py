"""int8_grouped's GEMM for Hopper in Gluon, with each group's promotion beside the next group's
MMA instead of after it.

    int8_mm_grouped(a, b, a_scale, out_dtype): the Triton kernels' computation and bits
    (dtrain/lowp/int8_grouped_triton.py: a (M, K) int8 row-major, b (K, N) int8 column-major,
    a_scale (M, groups) fp32 with a group's scales contiguous; out (M, N) = the sum over the
    groups j, in order, of float32(a[:, j] @ b[j]) * a_scale[:, j], in fp32).

Why Gluon: the Triton kernel ran at cuBLAS bf16's speed on an H200 (0.86-1.00x, bench/results/
2026-12-02-gpu-s30/) because Triton's compiler keeps a wgmma in flight only while its result
feeds the next wgmma's accumulator; a per-group promotion reads the result, so each K step
waited for its wgmma, promoted, and only then issued the next. Gluon exposes the wait's count
(`warpgroup_mma_wait(num_outstanding=1)`), so here each K step issues group j's wgmma
asynchronously, waits only for group j - 1's, and promotes that one while group j's runs on the
tensor cores: two int32 accumulators in registers, one in flight and one being promoted.

Loads: TMA into NUM_BUFFERS shared-memory stages, each with an mbarrier, issued
NUM_BUFFERS - 2 groups ahead as Triton's Gluon tutorial pipelines Hopper's wgmma (the slack
buffer keeps a load off the stage a warpgroup's wgmma may still read). One program per output
tile, grouped in GROUP_M rows of tiles for L2 reuse.

Not yet run on a GPU (written in the thirtieth session after its device time was spent): it is
compiled for sm_90a on CPU in tests/test_int8_triton.py (wgmma, the wait for one outstanding,
no spills), and `DTRAIN_INT8_GROUPED_GEMM=gluon` selects it (dtrain/lowp/switches.py); the
default stays the Triton kernel until the GPU tests (tests/gpu/test_int8_kernels.py) and the
GEMM micro-benchmark have run it.
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
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dtrain.lowp.int8_grouped import GROUP

# Gluon is experimental and renames: Triton 3.6 (what torch 2.11 ships) has
# tma.async_copy_global_to_shared, Triton 3.9 async_load (the old name raises).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# (BLOCK_M, BLOCK_N, num_warps, NUM_BUFFERS): BLOCK_K is the group. At 128 x 128 and 8 warps
# (two warpgroups of 64 rows) each accumulator is 64 registers a thread: the fp32 sum and the
# two int32 group sums take 192. 32 KB of shared memory a stage.
TILES = [(128, 128, 8, 4), (128, 128, 8, 3)]
_GROUP_M = 8


@gluon.jit
def _promote_add(acc, part, s):
    # acc + float32(part) * s, the multiply and the add each rounded to nearest as eager's
    # `out + part.float() * s` (no fused multiply-add, no flush to zero): the bits of the
    # portable path and of the Triton kernel (int8_grouped_triton._scaled_add).
    prod = gl.inline_asm_elementwise(
        "mul.rn.f32 $0, $1, $2;", "=f,f,f", [part.to(gl.float32), s], dtype=gl.float32,
        is_pure=True, pack=1,
    )  # fmt: skip
    return gl.inline_asm_elementwise(
        "add.rn.f32 $0, $1, $2;", "=f,f,f", [acc, prod], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def _issue_loads(a_desc, b_desc, a_bufs, b_bufs, bars, t, off_m, off_n, NUM_BUFFERS: gl.constexpr,
                 pred):  # fmt: skip
    """TMA loads of group t's tiles of a and b into stage t % NUM_BUFFERS (zeros past K)."""
    index = t % NUM_BUFFERS
    bar = bars.index(index)
    k = t * a_desc.block_type.shape[1]
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    _tma_load(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
    _tma_load(b_desc, [off_n, k], bar, b_bufs.index(index), pred)


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
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]  # b's tiles are (BLOCK_N, BLOCK_K)
    gl.static_assert(BLOCK_K == 128, "each K step must be one group of 128")
    gl.static_assert(NUM_BUFFERS >= 3, "one stage loading, one in the MMA, one of slack")

    # the output tile, grouped in GROUP_M rows of tiles (int8_triton._grouped_tile's order)
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows_here = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_here
    pid_n = (pid % width) // rows_here
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    # wgmma m64nNk32 (int8) per warpgroup; 8 warps stack two warpgroups along M
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma)

    a_bufs = gl.allocate_shared_memory(gl.int8, [NUM_BUFFERS, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.int8, [NUM_BUFFERS, BLOCK_N, BLOCK_K], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(i), count=1)

    k_tiles = gl.cdiv(K, BLOCK_K)
    AHEAD: gl.constexpr = NUM_BUFFERS - 2
    for t in gl.static_range(AHEAD):
        _issue_loads(a_desc, b_desc, a_bufs, b_bufs, bars, t, off_m, off_n, NUM_BUFFERS,
                     t < k_tiles)  # fmt: skip

    rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
    s_ptrs = s_ptr + (rows % M).to(gl.int64) * stride_sm  # rows past M: one inside, not stored
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, mma)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    prev = warpgroup_mma_init(zero)  # group j - 1's int32 sum (none before the first: 0 * 0)
    s_prev = gl.zeros([BLOCK_M], gl.float32, row_layout)
    for j in range(k_tiles):
        _issue_loads(a_desc, b_desc, a_bufs, b_bufs, bars, j + AHEAD, off_m, off_n, NUM_BUFFERS,
                     j + AHEAD < k_tiles)  # fmt: skip
        index = j % NUM_BUFFERS
        mbarrier.wait(bars.index(index), (j // NUM_BUFFERS) & 1)
        b_t = b_bufs.index(index).permute((1, 0))  # (BLOCK_K, BLOCK_N), K-major
        part = warpgroup_mma(a_bufs.index(index), b_t, zero, use_acc=False, is_async=True)
        s = gl.load(s_ptrs + j * stride_sg)  # this group's scales, used next step
        # group j - 1's wgmma done (j's may run on): promote it while j's runs
        done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
        acc = _promote_add(acc, done, gl.expand_dims(s_prev, 1))
        prev = part
        s_prev = s
    done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    acc = _promote_add(acc, done, gl.expand_dims(s_prev, 1))
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))

    cols = off_n + gl.arange(0, BLOCK_N, layout=col_layout)
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    offs = gl.expand_dims(rows.to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols * stride_cn, 0)
    gl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def descriptors(a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int):
    """TMA descriptors of a (M, K) row-major and of b (K, N) column-major read as (N, K)
    row-major: tiles (block_m, GROUP) and (block_n, GROUP), both K-major as int8 wgmma reads."""
    bt = b.t()
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, GROUP], gl.int8)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, GROUP], gl.int8)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [block_m, GROUP], a_layout)
    b_desc = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [block_n, GROUP], b_layout)
    return a_desc, b_desc


def launch(a, b, a_scale, out, tile: tuple = TILES[0]) -> None:
    """The grouped GEMM into `out` with `tile` = (BLOCK_M, BLOCK_N, num_warps, NUM_BUFFERS)."""
    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, warps, buffers = tile
    a_desc, b_desc = descriptors(a, b, block_m, block_n)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    with torch.cuda.device(a.device):
        _int8_mm_grouped_kernel[grid](
            a_desc, b_desc, out, a_scale, m, n, k, out.stride(0), out.stride(1),
            a_scale.stride(0), a_scale.stride(1), GROUP_M=_GROUP_M, NUM_BUFFERS=buffers,
            num_warps=warps,
        )  # fmt: skip
