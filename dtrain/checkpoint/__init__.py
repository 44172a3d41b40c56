"""Checkpoints: when to save, atomic (and async) save, discovery, and loading that trusts
nothing on disk. One file per concern, each importing only those listed above it:

    files.py        safe file primitives: what a path is, regular-file reads, new-file writes,
                    atomic writes, renames and removals, fsync, sha256
    layout.py       step folder names, which are complete, the newest, those past a step
    manifest.py     the manifest: read only once its marker vouches for it, its fields checked
    safe_load.py    the one place that decides what may be unpickled; every DCP load goes here
    rank_state.py   a rank's own state and RNG state: taken, read as plain values, checked
    integrity.py    what is checked before a checkpoint is read (checksums, objects, rank states)
    host_memory.py  host memory for the pinned staging buffers of async saves
    writer.py       DCP's storage writer of a save, and the line naming why a write failed
    manager.py      CheckpointManager: save (sync or async), commit, prune, load, resume=auto
    weights.py      a checkpoint's weights outside training, for generate and export

safe_load.py and weights.py are imported by path (dtrain.checkpoint.safe_load,
dtrain.checkpoint.weights), lazily where they are used: torch.distributed.checkpoint and the
model would otherwise come with every import of the package.
"""

from dtrain.checkpoint.files import create_new, open_regular, sha256_file
from dtrain.checkpoint.integrity import check_checkpoint, verify
from dtrain.checkpoint.layout import (
    MANIFEST,
    MARKER,
    check_newer,
    is_complete,
    latest_complete,
    list_complete,
    list_step_dirs,
)
from dtrain.checkpoint.manager import (
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointSaveError,
    Saved,
)

__all__ = [
    "MANIFEST",
    "MARKER",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Saved",
    "check_checkpoint",
    "check_newer",
    "create_new",
    "is_complete",
    "latest_complete",
    "list_complete",
    "list_step_dirs",
    "open_regular",
    "sha256_file",
    "verify",
]
