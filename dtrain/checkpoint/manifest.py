"""The manifest: reading it only once its COMPLETE marker's sha256 vouches for it, and its
fields checked against their types and ranges (a re-signed manifest is as untrusted as any
other input)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from dtrain.checkpoint.files import file_kind, read_regular
from dtrain.checkpoint.layout import MANIFEST, MARKER, STEP_RE
from dtrain.errors import CheckpointError

log = logging.getLogger("dtrain")

_MARKER_RE = re.compile(r"^([0-9a-f]{64})  " + re.escape(MANIFEST) + r"\n?$")
LEGACY_MARKER = "ok\n"  # dtrain before the manifest checksum; accepted with a warning
_legacy_warned: set[Path] = set()  # one warning per checkpoint, not one per read


MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists a few files per rank and the run's config
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def plain_name(name: object) -> bool:
    """A file name inside the checkpoint folder: no path, no parent, no NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and not set(name) & {"/", "\0"}


def _count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def manifest_problem(manifest: dict) -> str | None:
    """The first field of a (signed) manifest of the wrong type or out of range, as one line
    naming it, or None: a re-signed manifest is as untrusted as any other input."""
    files, sizes = manifest.get("files"), manifest.get("sizes", {})
    if not isinstance(files, dict) or not files:
        return f"'files' must map file names to sha256 digests, got {_short(files)}"
    for name, digest in files.items():
        if not plain_name(name):
            return f"'files' names a file outside the checkpoint: {name!r}"
        if not isinstance(digest, str) or not _SHA256_RE.match(digest):
            return f"'files'[{name!r}] must be a sha256 hex digest, got {_short(digest)}"
    if not isinstance(sizes, dict):
        return f"'sizes' must map file names to byte counts, got {_short(sizes)}"
    for name, size in sizes.items():
        if name not in files or not _count(size, 0):
            return f"'sizes'[{name!r}] must be the byte count of a listed file, got {_short(size)}"
    if "world_size" in manifest and not _count(manifest["world_size"], 1):
        return f"'world_size' must be an integer >= 1, got {_short(manifest['world_size'])}"
    for key in ("identity", "data", "config"):
        if key in manifest and not isinstance(manifest[key], dict):
            return f"'{key}' must be a JSON object, got {_short(manifest[key])}"
    for part in ("model", "data"):
        value = manifest.get("config", {}).get(part, {})
        if not isinstance(value, dict):
            return f"'config.{part}' must be a JSON object, got {_short(value)}"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint folder `path`, checked against its marker, its step
    against the folder's name, its fields against their types; CheckpointError otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a file; a checkpoint is a checkpoints/step_NNNNNNN folder"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / "latest").is_file() or any(path.glob("global_step*")):
        # engine.save_checkpoint's layout: its ZeRO partitions are laid out for one world
        # size and DeepSpeed version; dtrain's zero1/2/3 write the common format instead.
        raise CheckpointError(
            f"checkpoint {path} is a native DeepSpeed checkpoint, not a dtrain one; "
            f"consolidate its weights with DeepSpeed's `python {path}/zero_to_fp32.py {path} "
            "OUT_DIR` and start a new run from them (dtrain's zero1/2/3 save its own format)"
        )
    if file_kind(path / MARKER) == "missing":
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER} marker): it was interrupted "
            f"while being written; resume from an earlier one or use resume=auto"
        )
    if file_kind(path / MANIFEST) == "missing":
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} is missing (its {MARKER} marker is there, so it "
            "was removed after the save)"
        )
    try:
        marker = read_regular(path / MARKER, 4096).decode()
        raw = read_regular(path / MANIFEST, MANIFEST_MAX_BYTES)
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {path}: unreadable {MARKER} or {MANIFEST} ({e})"
        ) from None
    signed = _MARKER_RE.match(marker)
    if signed and hashlib.sha256(raw).hexdigest() != signed.group(1):
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} was edited or is corrupt (its sha256 differs "
            f"from the one in {MARKER})"
        )
    if not signed and marker != LEGACY_MARKER:
        raise CheckpointError(
            f"checkpoint {path}: {MARKER} holds no sha256 of {MANIFEST}, so the manifest "
            "cannot be checked"
        )
    if not signed and path.resolve() not in _legacy_warned:
        _legacy_warned.add(path.resolve())
        log.warning(
            "checkpoint %s was saved by an older dtrain: %s has no checksum of %s, which is "
            "trusted unchecked (`sha256sum %s > %s` in that folder records it)",
            path,
            MARKER,
            MANIFEST,
            MANIFEST,
            MARKER,
        )
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({e})") from None
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} has no valid step ({step!r})")
    why = manifest_problem(manifest)
    if why:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed: {why}")
    named = STEP_RE.match(path.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} says step {step} but the folder is {path.name}"
        )
    return manifest
