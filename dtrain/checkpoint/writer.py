"""The writing side of a save: DCP's storage writer (new regular files only, with a fault
injection point before this rank's shards) and the one line that names why a write failed."""

from __future__ import annotations

import os
from pathlib import Path

from dtrain.reliability import faults


def _free_bytes(path: Path) -> int | None:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# Below this, a failed write is put down to a full disk: PyTorch's zip writer reports ENOSPC
# as "RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...".
FULL_DISK_BYTES = 16 << 20


def describe_save_error(e: BaseException, folder: Path) -> str | None:
    """An OS-level cause of a failed save as one line, or None if `e` is a bug (re-raise)."""
    if isinstance(e, OSError):
        return str(e)
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if isinstance(failures, dict):
        for rank, exc in sorted(failures.items()):
            # DCP wraps each as (exception, stack summary)
            inner = exc[0] if isinstance(exc, tuple) and exc else getattr(exc, "exc", exc)
            if isinstance(inner, OSError):
                return f"{inner} (rank {rank})"
    free = _free_bytes(folder)
    if free is not None and free < FULL_DISK_BYTES:
        first = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        return (
            f"No space left on device ({free} bytes free under {folder}; the writer said: {first})"
        )
    return None


def storage_writer(partial: Path, step: int, *, keep_host_buffers: bool = False):
    """DCP's file writer, with an injection point where this rank's shards are about to be
    written (in DCP's own thread in an async save): `writer.step` names the save.

    keep_host_buffers (async saves, one writer for the run): the writer stages the state into
    pinned host buffers made at its first save and reused by the next ones
    (cache_staged_state_dict). Without them every async save allocated pageable host memory
    and copied into it: at 1b under fsdp on 2x H200 the loop stalled 24.5-26.5 s a save,
    against 27.1-30.4 s for a synchronous one (docs/benchmarks.md, "Checkpoint stall")."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            faults.point("ckpt.save.write", step=self.step)
            return super().write_data(plan, planner)

    from dtrain.checkpoint.safe_load import RegularFiles

    writer = Writer(str(partial), cache_staged_state_dict=keep_host_buffers)
    writer.fs = RegularFiles()  # shards are new files in the new folder: never through a link
    writer.step = step
    return writer
