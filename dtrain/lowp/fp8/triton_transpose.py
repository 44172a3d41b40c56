"""A Triton kernel for dtrain::fp8_transpose (dtrain/lowp/fp8/layout.py): a 2-D transpose of a
1-byte tensor, tile by tile, so both the reads and the writes are coalesced.

Imported only on CUDA (Triton comes with torch's CUDA wheels). With TRITON_INTERPRET=1 it runs
on CPU tensors in Triton's interpreter (the CPU test). Not torch.compile: the op runs inside
compiled graphs, and a compiled function called from one recursed without end in Dynamo's
runtime bookkeeping (torch 2.11, H200, 2026-11-27).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_BLOCK = 64  # 64 x 64 bytes a tile: each row of a tile is one 64-byte load or store


@triton.jit
def _transpose_kernel(src, dst, M, N, BLOCK: tl.constexpr):
    # One program per tile, the tiles numbered along a 1-D grid (axis 0 takes 2**31 - 1
    # programs; axes 1 and 2 only 65,535).
    tiles_n = tl.cdiv(N, BLOCK)
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // tiles_n) * BLOCK + tl.arange(0, BLOCK)
    cols = (pid % tiles_n) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tile = tl.load(src + rows[:, None] * N + cols[None, :], mask=mask)
    tl.store(dst + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """x (M, N), 1 byte an element -> x.t() contiguous, a new tensor. The kernel reads x
    row-major: any other layout is made contiguous first (in compiled graphs it already is)."""
    x = x.contiguous()
    m, n = x.shape
    out = torch.empty((n, m), dtype=x.dtype, device=x.device)
    if x.numel():
        grid = (triton.cdiv(m, _BLOCK) * triton.cdiv(n, _BLOCK),)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _transpose_kernel[grid](x.view(torch.uint8), out.view(torch.uint8), m, n, BLOCK=_BLOCK)
    return out
