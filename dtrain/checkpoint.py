"""Checkpoints: when to save, atomic save, discovery of the newest complete one, resume.

Layout of one checkpoint (torch.distributed.checkpoint, one shard file per rank):

    checkpoints/step_0000100/
        __0_0.distcp ...      model + optimizer shards (DCP)
        .metadata             DCP's index of the shards
        extra_rank{r}.pt      per-rank RNG states (weights_only-loadable)
        manifest.json         step, run identity, data position, sha256 of every file
        COMPLETE              the marker, written last: the sha256 of manifest.json
                              (`sha256sum -c COMPLETE` in the folder checks it)

A checkpoint is written under `step_NNNNNNN.partial/` and renamed to `step_NNNNNNN/` only after
every rank has finished and the manifest and marker are on disk: a crash at any point leaves
either the previous checkpoint set or a `.partial` folder that discovery ignores. Old ones are
pruned (renamed to `.deleting`, then removed) only after a newer one is complete.

Loading trusts nothing on disk: the manifest is checked against the marker's sha256 and its
step against the folder's name, every file's sha256 against the manifest (a truncated or
altered shard is named), DCP's pickled `.metadata` is first read by an unpickler that only
admits DCP's own metadata classes, the pickled non-tensor items inside the shards (the
optimizer's param_groups) are read as plain values only (dtrain.safe_load), and
`extra_rank*.pt` is read with `torch.load(weights_only=True)`. No code in a checkpoint runs.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch

from dtrain import dist as ddist
from dtrain import faults
from dtrain.config import CheckpointConfig
from dtrain.errors import CheckpointError

# DCP warns on every save/load without a process group; a single process is intended there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")

log = logging.getLogger("dtrain")

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{7,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / MANIFEST).is_file()


def list_complete(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ckpt_root, oldest first."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = _STEP_RE.match(p.name)
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
    found = ((_STEP_RE.match(p.name), p) for p in ckpt_root.iterdir())
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


_MARKER_RE = re.compile(r"^([0-9a-f]{64})  " + re.escape(MANIFEST) + r"\n?$")
LEGACY_MARKER = "ok\n"  # dtrain before the manifest checksum; accepted with a warning
_legacy_warned: set[Path] = set()  # one warning per checkpoint, not one per read


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, unwritable folder, ...); nothing was marked complete."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another run (model, data, ...): resume=auto must not skip past it."""


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


def _describe_save_error(e: BaseException, folder: Path) -> str | None:
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


# What DCP's .metadata may contain; anything else in it is refused before DCP unpickles it.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        ok = (module, name) in _SAFE_GLOBALS
        ok = ok or (module in _DCP_MODULES and not name.startswith("__"))
        ok = ok or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not ok:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}")
        obj = super().find_class(module, name)
        if module in _DCP_MODULES and not isinstance(obj, type):
            if not (module.endswith("metadata") and name == "_MEM_FORMAT_ENCODING"):
                raise pickle.UnpicklingError(f"refused to load {module}.{name}")
        return obj


def check_metadata(path: Path) -> None:
    """Read DCP's pickled .metadata with an allow-list unpickler (DCP itself uses pickle.load)."""
    meta = Path(path) / ".metadata"
    try:
        _MetadataUnpickler(io.BytesIO(meta.read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: .metadata is missing") from None
    except Exception as e:  # any unpickling failure: refuse, naming the file
        raise CheckpointError(
            f"checkpoint {path}: .metadata is not a plain DCP index, refused to load it ({e})"
        ) from None


def check_checkpoint(
    path: Path, manifest: dict, *, files: bool = True, rank: int = 0, world_size: int = 1
) -> None:
    """What every loader checks before DCP reads a checkpoint: the checksums (`files`;
    collective under torchrun), the .metadata allow-list, and that every pickled item in the
    shards is a plain value. A CheckpointError names the first problem."""
    from dtrain.safe_load import check_objects

    if files:
        verify(path, manifest, rank, world_size)
    check_metadata(path)
    check_objects(path)


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
            if "/" in name or name in ("..", "."):
                bad = f"{MANIFEST} names a file outside the checkpoint: {name!r}"
            elif not f.is_file():
                bad = f"{name} is missing"
            elif name in sizes and f.stat().st_size != sizes[name]:
                got = f.stat().st_size
                bad = f"{name} is truncated or padded ({got} bytes, expected {sizes[name]})"
            elif sha256_file(f) != files[name]:
                bad = f"{name} is corrupt (sha256 differs from {MANIFEST})"
            if bad:
                break
    # world_size 1: a single-process check (also rank 0 deciding alone for all ranks).
    verdicts = ddist.all_gather_object(bad) if world_size > 1 else [bad]
    first = next((v for v in verdicts if v), None)
    if first:
        raise CheckpointError(f"checkpoint {path}: {first}")


class CheckpointManager:
    def __init__(self, run_dir: Path, cfg: CheckpointConfig, rank: int, world_size: int):
        self.root = Path(run_dir) / "checkpoints"
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._verified: set[Path] = set()  # checked by find_resumable: not hashed twice
        self.rejected: list[Path] = []  # skipped by find_resumable, newest first

    def due(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    # --- save --------------------------------------------------------------------------
    def save(self, step: int, state: dict, manifest: dict) -> Path:
        """Save `state` (DCP state dict) at `step`. Collective: every rank calls it.

        An OS error on any rank (disk full, read-only or vanished folder) becomes a
        CheckpointSaveError on every rank, after the .partial folder is removed; the
        previous complete checkpoint is untouched. Other exceptions are bugs and propagate.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + ".partial")
        err = None
        if self.rank == 0:
            try:
                faults.point("ckpt.save.begin", step=step)
                self.root.mkdir(parents=True, exist_ok=True)
                if partial.exists():  # left by a crash: never part of a complete checkpoint
                    shutil.rmtree(partial)
                partial.mkdir()
            except OSError as e:
                err = f"{e}"
        err = ddist.broadcast_object(err)  # also the barrier before anyone writes
        result: dict | str = {}
        if err is None:
            try:
                faults.point("ckpt.save.after_mkdir", step=step)
                dcp.save(state, checkpoint_id=str(partial))
                faults.point("ckpt.save.after_dcp", step=step)
                extra_path = partial / f"extra_rank{self.rank}.pt"
                torch.save({"rng": rng_state()}, extra_path)
                faults.point("ckpt.save.after_extra", step=step)
                # Each rank hashes the files it wrote; rank 0 gathers them into the manifest.
                mine = [extra_path] + sorted(partial.glob(f"__{self.rank}_*.distcp"))
                result = {p.name: (sha256_file(p), p.stat().st_size) for p in mine}
            except (Exception, CheckpointException) as e:  # the latter is a BaseException
                why = _describe_save_error(e, partial)
                if why is None:
                    raise
                result = f"{why} (rank {self.rank})" if "(rank " not in why else why
        gathered = ddist.all_gather_object(result if err is None else err)
        err = err or next((g for g in gathered if isinstance(g, str)), None)
        if self.rank == 0 and err is None:
            try:
                faults.point("ckpt.save.after_hash", step=step)
                files = {}
                for g in gathered:
                    files.update(g)
                if (partial / ".metadata").exists():
                    meta = partial / ".metadata"
                    files[".metadata"] = (sha256_file(meta), meta.stat().st_size)
                manifest = {
                    **manifest,
                    "step": step,
                    "world_size": self.world_size,
                    "files": {k: v[0] for k, v in files.items()},
                    "sizes": {k: v[1] for k, v in files.items()},
                }
                _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
                faults.point("ckpt.save.after_manifest", step=step)
                # The marker signs the manifest: an edited step or data position is refused.
                _write_atomic(partial / MARKER, marker_text(sha256_file(partial / MANIFEST)))
                faults.point("ckpt.save.after_marker", step=step)
                if final.exists():  # an older save of the same step (e.g. rerun): replace it
                    shutil.rmtree(final)
                os.replace(partial, final)
                _fsync_dir(self.root)
            except OSError as e:
                err = str(e)
            if err is None:
                faults.point("ckpt.save.after_rename", step=step)
                self._prune()
        err = ddist.broadcast_object(err)
        if err is not None:
            if self.rank == 0:  # nothing half-written stays behind, and nothing is complete
                shutil.rmtree(partial, ignore_errors=True)
            latest = latest_complete(self.root)
            raise CheckpointSaveError(
                f"checkpoint {final.name} could not be saved: {err}; nothing was marked "
                f"complete; the newest complete checkpoint is "
                f"{latest.name if latest else 'none'}"
            )
        return final

    def _prune(self) -> None:
        """Keep the newest keep_last complete checkpoints; called only after a new one is
        complete, so the last complete checkpoint is never deleted before its successor.

        Each victim is first renamed to `.deleting` (atomic), so a crash in the middle of
        removing it never leaves a half-deleted folder that still looks complete."""
        # A .partial folder here is left by a save that died (saves never overlap): drop it.
        for stale in self.root.glob("step_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        for leftover in self.root.glob("step_*.deleting"):
            shutil.rmtree(leftover, ignore_errors=True)
        if self.cfg.keep_last <= 0:
            return
        complete = list_complete(self.root)
        for _, path in complete[: -self.cfg.keep_last]:
            doomed = path.with_name(path.name + ".deleting")
            try:
                os.replace(path, doomed)
                faults.point("ckpt.prune")
                shutil.rmtree(doomed)
            except OSError as e:  # a full disk must not turn a good save into a failure
                log.warning("could not remove old checkpoint %s: %s", path, e)

    # --- load --------------------------------------------------------------------------
    @staticmethod
    def read_manifest(path: Path) -> dict:
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
        if not (path / MARKER).is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete (no {MARKER} marker): it was interrupted "
                f"while being written; resume from an earlier one or use resume=auto"
            )
        if not (path / MANIFEST).is_file():
            raise CheckpointError(
                f"checkpoint {path}: {MANIFEST} is missing (its {MARKER} marker is there, so it "
                "was removed after the save)"
            )
        try:
            marker, raw = (path / MARKER).read_text(), (path / MANIFEST).read_bytes()
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
        named = _STEP_RE.match(path.name)
        if named and int(named.group(1)) != step:
            raise CheckpointError(
                f"checkpoint {path}: {MANIFEST} says step {step} but the folder is {path.name}"
            )
        return manifest

    def _check(self, path: Path, manifest: dict) -> None:
        rank, world = self.rank, self.world_size
        check_checkpoint(path, manifest, files=self.cfg.verify, rank=rank, world_size=world)

    def load(self, path: Path, state: dict) -> dict:
        """Load into `state` (a DCP state dict template) in place; return the manifest."""
        from dtrain.safe_load import load_into

        path = Path(path)
        manifest = self.read_manifest(path)
        if path not in self._verified:
            self._check(path, manifest)
        load_into(path, state)
        extra = path / f"extra_rank{self.rank}.pt"
        if manifest.get("world_size") == self.world_size and extra.exists():
            try:  # weights_only: tensors and plain containers, never arbitrary objects
                rng = torch.load(extra, weights_only=True)["rng"]
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointError(
                    f"checkpoint {path}: {extra.name} holds more than tensors, refused to "
                    f"unpickle it ({first})"
                ) from None
            set_rng_state(rng)
        return manifest

    def find_resumable(self, accept=None) -> tuple[Path, dict] | None:
        """resume=auto: the newest checkpoint folder that passes every check.

        One that fails (no marker, a missing, edited or corrupt manifest, a corrupt file) is
        skipped with a warning naming it and why, and the previous one is tried; the skipped
        ones are listed in self.rejected (see set_aside). `accept(path, manifest)` may raise
        CheckpointError to stop the search (e.g. a checkpoint of another model: falling back
        would silently resume the wrong run). None if there is no checkpoint folder;
        CheckpointError if none is intact.
        """
        found = list_step_dirs(self.root)
        problems = []
        self.rejected = []
        for i, (_, path) in enumerate(reversed(found)):
            try:
                if not (path / MARKER).is_file():  # read_manifest's advice is for resume=PATH
                    raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
                manifest = self.read_manifest(path)
                if accept is not None:
                    accept(path, manifest)
                self._check(path, manifest)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                problems.append(str(e))
                self.rejected.append(path)
                if self.rank == 0:
                    nxt = found[-2 - i][1].name if i + 1 < len(found) else None
                    log.warning(
                        "%s; %s", e, f"falling back to {nxt}" if nxt else "no older checkpoint"
                    )
                continue
            self._verified.add(path)
            return path, manifest
        if not found:
            return None
        raise CheckpointError(
            f"no intact checkpoint in {self.root}: "
            + " | ".join(problems)
            + "; move the bad ones away, or start a new run dir"
        )

    def set_aside(self, paths: list[Path]) -> None:
        """Rename checkpoints that resume=auto skipped to `<name>.rejected`: kept as evidence,
        out of reach of discovery, pruning and the save of the same step."""
        for path in paths:
            target, n = path.with_name(path.name + ".rejected"), 1
            while target.exists():
                n += 1
                target = path.with_name(f"{path.name}.rejected{n}")
            try:
                os.replace(path, target)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint {path} was skipped but could not be set aside ({e}); this run "
                    "would overwrite it: move it out of the checkpoints folder"
                ) from None
            log.warning(
                "kept the skipped checkpoint %s as %s: it is never loaded, overwritten or "
                "pruned; delete it once it is no longer needed",
                path.name,
                target.name,
            )

    def remove_newer(self, step: int) -> None:
        """checkpoint.overwrite_newer=true: delete the checkpoints past the resume point, so
        that this run's checkpoints never mix with the abandoned ones (rank 0)."""
        for path in newer_checkpoints(self.root, step):
            doomed = path.with_name(path.name + ".deleting")  # never half-deleted yet complete
            try:
                os.replace(path, doomed)
                shutil.rmtree(doomed)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint {path} (newer than the resume point) could not be deleted "
                    f"({e}); move it out of the checkpoints folder"
                ) from None
            log.warning(
                "deleted checkpoint %s, newer than the resume point (checkpoint.overwrite_newer)",
                path,
            )
