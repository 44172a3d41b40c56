"""Host buffers for async checkpoints: one page-locked allocation per rank, laid out as the
state dict it stages.

DCP's writer keeps the buffers it stages into from one async save to the next
(`cache_staged_state_dict`), but makes them at the first save the slow way (torch 2.11-2.13,
`_create_cpu_state_dict`): it copies each DTensor whole to pageable host memory, allocates a
pinned tensor of its size through torch's caching host allocator (which rounds every
allocation up to a power of two) and only then copies the state once more. At 1b under fsdp on
2x H200 that first save stalled the loop 13.0 s against 0.28 s for the next
(docs/benchmarks.md, "Checkpoint save").

`host_buffers` makes the same structure from one pageable allocation of the exact size,
page-locked once (cudaHostRegister, as DCP does for shared buffers), carved into one view per
tensor; handed to the writer as its cache, the first save only copies into it.
"""

from __future__ import annotations

import weakref

import torch

_ALIGN = 64  # bytes: every view starts on a cache line (and any dtype's alignment)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if _is_dtensor(t) else t


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _needs_room(t: torch.Tensor) -> bool:
    # As DCP: 0-dim tensors get a small tensor of their own, empty ones a zero-size tensor.
    local = _local(t)
    return t.dim() > 0 and local.numel() > 0


def _room(nbytes: int) -> int:
    """Bytes a view of `nbytes` takes in the buffer: the next one starts _ALIGN-aligned."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _pin(flat: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(flat.data_ptr(), flat.numel(), 1))  # 1: portable
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {flat.numel() / 1024**3:.2f} GiB failed ({err})")
    # Unpinned when the buffer object goes (its holder, the writer, is dropped at the end of
    # the run); the views alone do not keep this object.
    weakref.finalize(flat, cudart.cudaHostUnregister, flat.data_ptr())


def host_buffers(state: dict, *, pin: bool) -> tuple[dict, torch.Tensor]:
    """A host copy of `state`'s structure (values not copied) for DCP's staging cache, and the
    one buffer behind it (uint8), page-locked where `pin` until that buffer object is dropped:
    the caller keeps it as long as the copy is used. Tensors become views into the buffer;
    DTensors keep their mesh and placements around a host local tensor; other values are kept
    as they are."""
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor) and _needs_room(t)]
    total = sum(_room(_local(t).nbytes) for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8)
    if pin and total:
        _pin(flat)
    offset = 0

    def view(local: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        out = flat[offset : offset + local.nbytes].view(local.dtype).view(local.shape)
        offset += _room(local.nbytes)
        return out

    def mirror(obj):
        if isinstance(obj, dict):
            return {k: mirror(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [mirror(v) for v in obj]
        if isinstance(obj, tuple):  # a plain tuple, namedtuples too, as DCP's own copy makes
            return tuple(mirror(v) for v in obj)
        if not isinstance(obj, torch.Tensor):
            return obj
        if _is_dtensor(obj):
            if obj.dim() == 0:
                return obj
            local = obj._local_tensor
            host = view(local) if local.numel() else torch.zeros_like(local, device="cpu")
            return type(obj)(host, obj._spec, requires_grad=False)
        if obj.dim() == 0:
            return torch.tensor(0, dtype=obj.dtype)
        return view(obj) if obj.numel() else torch.zeros_like(obj, device="cpu")

    return mirror(state), flat
