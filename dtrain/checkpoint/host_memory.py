"""Host memory for async saves' pinned staging buffers: whether they are used, how much memory
this node's processes can still take (a memory cgroup's limit included), and how many bytes a
rank's state needs."""

from __future__ import annotations

import torch


def pinned_staging() -> bool:
    """Async saves keep pinned host buffers where there is a GPU to copy from."""
    return torch.cuda.is_available()


# The share of a node's available memory its ranks' pinned staging buffers may take: the rest
# stays for the data loaders, the page cache DCP writes through, and everything else.
HOST_SHARE = 0.7


# A memory cgroup's limit and usage (v2, then v1), read where the process runs in one (a
# container, a Slurm job): MemAvailable is the whole host's.
CGROUP_MEMORY = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_host_bytes() -> int | None:
    """The memory this node's processes can still take: MemAvailable (Linux), or less where a
    memory cgroup's limit leaves less; None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in CGROUP_MEMORY:
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = int(f.read()), int(g.read())  # "max" (no limit): ValueError
        except (OSError, ValueError):
            continue
        if limit < 2**60:  # v1 writes "no limit" as a number near 2**63
            room = max(limit - usage, 0)
            avail = room if avail is None else min(avail, room)
        break
    return avail


def host_bytes(state: dict) -> int:
    """Bytes of this rank's tensors in a state dict (a DTensor: its local shard)."""
    from torch.utils._pytree import tree_leaves

    leaves = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in leaves)
