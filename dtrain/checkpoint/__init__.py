"""Checkpoints: policy, atomic (and async) save, discovery, safe loading, weights for export."""

from dtrain.checkpoint.manager import (
    MANIFEST,
    MARKER,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointSaveError,
    Saved,
    _available_host_bytes,
    _write_atomic,
    check_checkpoint,
    check_newer,
    create_new,
    is_complete,
    latest_complete,
    list_complete,
    list_step_dirs,
    open_regular,
    sha256_file,
    verify,
)
