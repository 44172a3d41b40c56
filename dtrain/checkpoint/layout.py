"""Where checkpoints lie: the step_NNNNNNN folder names, which folders are complete, the newest
one, and the checkpoints past a step that a resume would overwrite."""

from __future__ import annotations

import re
from pathlib import Path

from dtrain.checkpoint.files import file_kind
from dtrain.errors import CheckpointError

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
STEP_RE = re.compile(r"^step_(\d{7,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def is_complete(path: Path) -> bool:
    return file_kind(path / MARKER) == "file" and file_kind(path / MANIFEST) == "file"


def list_complete(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ckpt_root, oldest first."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_complete(ckpt_root: Path) -> Path | None:
    found = list_complete(ckpt_root)
    return found[-1][1] if found else None


def list_step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Every step_NNNNNNN folder under ckpt_root, complete or not, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = ((STEP_RE.match(p.name), p) for p in ckpt_root.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())


def newer_checkpoints(ckpt_root: Path, step: int) -> list[Path]:
    """Checkpoint folders past `step`: what a run starting at `step` would overwrite or prune."""
    return [p for n, p in list_step_dirs(ckpt_root) if n > step]


def check_newer(ckpt_root: Path, start: Path, step: int, allowed: bool) -> list[Path]:
    """resume=<start> at `step` into a run dir holding later checkpoints: refused unless
    `allowed` (checkpoint.overwrite_newer); returns those checkpoints."""
    newer = newer_checkpoints(Path(ckpt_root), step)
    if newer and not allowed:
        names = ", ".join(p.name for p in newer)
        raise CheckpointError(
            f"resume={start} starts at step {step} but {ckpt_root} holds newer checkpoints "
            f"({names}) that this run would overwrite or prune; resume from the newest, move "
            "them out of that folder, or set checkpoint.overwrite_newer=true to delete them"
        )
    return newer


def marker_text(manifest_sha256: str) -> str:
    """What COMPLETE holds: sha256sum's line for manifest.json."""
    return f"{manifest_sha256}  {MANIFEST}\n"
