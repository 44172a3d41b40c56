"""What is checked before a checkpoint is read: every file against the manifest's sha256 and
size, spread over the ranks (verify), then everything a loader checks first (check_checkpoint):
file kinds, checksums, the pickled items and every rank's own state."""

from __future__ import annotations

import os
from pathlib import Path

from dtrain import dist as ddist
from dtrain.checkpoint.files import file_kind, sha256_file
from dtrain.checkpoint.layout import MANIFEST
from dtrain.checkpoint.manifest import plain_name
from dtrain.checkpoint.rank_state import EXTRA_RE, read_rank_state
from dtrain.errors import CheckpointError


def check_checkpoint(
    path: Path, manifest: dict, *, files: bool = True, rank: int = 0, world_size: int = 1
) -> None:
    """What every loader checks before DCP reads a checkpoint: that every file the manifest
    lists is a regular file, the checksums (`files`; collective under torchrun), the .metadata
    allow-list and the files it names, that every pickled item in the shards is a plain value,
    and every rank's own state. A CheckpointError names the first problem."""
    # lazily: safe_load imports torch.distributed.checkpoint, most of a second
    from dtrain.checkpoint.safe_load import check_objects

    listed = manifest["files"]
    for name in sorted(listed):
        kind = file_kind(Path(path) / name)
        if kind != "file":
            what = "missing" if kind == "missing" else f"{kind}, not a regular file"
            raise CheckpointError(f"checkpoint {path}: {name} is {what}")
    if files:
        verify(path, manifest, rank, world_size)
    check_objects(path, listed)
    for name in sorted(n for n in listed if EXTRA_RE.match(n)):
        read_rank_state(Path(path), name)


def verify(path: Path, manifest: dict, rank: int = 0, world_size: int = 1) -> None:
    """Check every file against the manifest's sha256 (and size); collective under torchrun.

    Rank r hashes every world_size-th file, so a checkpoint is read once in all, not once
    per rank; every rank then sees the same verdict.
    """
    files = manifest.get("files")
    bad = None
    if not isinstance(files, dict) or not files:
        bad = f"{MANIFEST} lists no files to check"
    else:
        sizes = manifest.get("sizes", {})
        for name in sorted(files)[rank::world_size]:
            f = Path(path) / name
            kind = file_kind(f)
            if not plain_name(name):
                bad = f"{MANIFEST} names a file outside the checkpoint: {name!r}"
            elif kind != "file":
                bad = f"{name} is missing" if kind == "missing" else f"{name} is {kind}"
            elif name in sizes and os.lstat(f).st_size != sizes[name]:
                got = os.lstat(f).st_size
                bad = f"{name} is truncated or padded ({got} bytes, expected {sizes[name]})"
            else:
                try:
                    if sha256_file(f) != files[name]:
                        bad = f"{name} is corrupt (sha256 differs from {MANIFEST})"
                except CheckpointError as e:  # swapped for something else since the check
                    bad = str(e).split(": ", 1)[-1]
            if bad:
                break
    # world_size 1: a single-process check (also rank 0 deciding alone for all ranks).
    verdicts = ddist.all_gather_object(bad) if world_size > 1 else [bad]
    first = next((v for v in verdicts if v), None)
    if first:
        raise CheckpointError(f"checkpoint {path}: {first}")
