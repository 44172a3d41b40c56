"""Checkpoints: when to save, atomic save, discovery of the newest complete one, resume.

Layout of one checkpoint (torch.distributed.checkpoint, one shard file per rank):

    checkpoints/step_0000100/
        __0_0.distcp ...      model + optimizer shards (DCP)
        .metadata             DCP's index of the shards
        extra_rank{r}.pt      per-rank RNG state and the rank's own state, e.g. fp8 delayed
                              scaling's amax histories (weights_only-loadable)
        manifest.json         step, run identity, data position, sha256 of every file
        COMPLETE              the marker, written last: the sha256 of manifest.json
                              (`sha256sum -c COMPLETE` in the folder checks it)

A checkpoint is written under `step_NNNNNNN.partial/` and renamed to `step_NNNNNNN/` only after
every rank has finished and the manifest and marker are on disk: a crash at any point leaves
either the previous checkpoint set or a `.partial` folder that discovery ignores. Old ones are
pruned (renamed to `.deleting`, then removed) only after a newer one is complete.

checkpoint.async_save: save_async() takes the same snapshot at the save's step (DCP copies the
tensors to host memory, on CUDA into pinned buffers kept from one save to the next; the RNG
state and the manifest are taken then) and writes, fsyncs, hashes and commits it in a background
thread, on a gloo process group of its own, while the loop trains on. COMPLETE is written, as in
save(), only after every rank's files are fsynced and hashed. One save at a time: the next one,
the end of the run or a stop waits for it (finish()); a failure is the same CheckpointSaveError,
raised on the main thread.

Loading trusts nothing on disk: the manifest is checked against the marker's sha256 and its
step against the folder's name, every file's sha256 against the manifest (a truncated or
altered shard is named), the manifest's fields against their types and ranges, DCP's pickled
`.metadata` is read by an unpickler that admits an exact list of DCP's own metadata classes,
the pickled non-tensor items inside the shards (the optimizer's param_groups) and
`extra_rank*.pt` are read as plain values only (dtrain.checkpoint.safe_load), and each rank's RNG state is
checked before it is applied. Loaders open only regular files the manifest lists: a link, FIFO,
socket, device or directory in their place is refused without being opened or followed. No
code in a checkpoint runs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from dtrain import dist as ddist
from dtrain import faults
from dtrain.config import CheckpointConfig
from dtrain.errors import CheckpointError, ConfigError
from dtrain.host_staging import host_buffers

# DCP warns on every save/load without a process group; a single process is intended there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")

log = logging.getLogger("dtrain")

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{7,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def file_kind(path: Path) -> str | None:
    """What `path` is, without following a link or opening it: "file" (regular), "missing",
    or what it is instead ("a symbolic link", "a FIFO", ...)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if stat.S_ISREG(mode):
        return "file"
    kinds = {
        stat.S_ISLNK: "a symbolic link",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a device",
        stat.S_ISBLK: "a device",
        stat.S_ISDIR: "a directory",
    }
    return next((k for test, k in kinds.items() if test(mode)), "not a regular file")


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path` if it is a regular file and no link: anything else in
    a checkpoint (a FIFO that would block, a device, a link leaving the folder) is refused
    before it is opened. CheckpointError names it."""
    kind = file_kind(path)
    if kind == "missing":
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is missing")
    if kind != "file":
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is {kind}, not a regular file; refused to "
            "open it"
        )
    try:  # O_NONBLOCK: a FIFO swapped in after the check still cannot block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is unreadable ({e})"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is not a regular file; refused to read it"
        )
    os.set_blocking(fd, True)
    return fd


def is_complete(path: Path) -> bool:
    return file_kind(path / MARKER) == "file" and file_kind(path / MANIFEST) == "file"


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
    with os.fdopen(open_regular(Path(path)), "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def create_new(path: Path, mode: str = "wb"):
    """A new file at `path`, opened for writing: never through a link, never over a file that
    is there already (FileExistsError names it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o644), mode)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with create_new(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if os.path.lexists(path):  # the folder is this save's own: anything there was planted
        raise FileExistsError(
            errno.EEXIST, "refused to replace a file this save did not make", path
        )
    os.replace(tmp, path)


def _remove_own_dir(path: Path, quiet: bool = False) -> None:
    """Remove a folder a save left (a .partial, a .deleting, an older save of the step); a link
    or file in its place was not made by a save: refused (OSError), or left alone (`quiet`)."""
    kind = file_kind(path)
    if kind == "missing":
        return
    if kind != "a directory":
        if quiet:
            return
        raise OSError(errno.EEXIST, f"{kind} is in the way, refused to replace it", str(path))
    shutil.rmtree(path, ignore_errors=quiet)  # never follows links inside it


def _rename_new(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, which must not exist: never over a file or link it did not make."""
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, "refused to replace what is there", str(dst))
    os.replace(src, dst)


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


class Loaded(NamedTuple):
    """What CheckpointManager.load gives back besides the state it loaded."""

    manifest: dict
    rank_state: dict | None  # save()'s rank_state: this rank's, or that of `from_rank`
    from_rank: int | None  # None: this rank's own; else the number of ranks changed, this one
    # modulo the saved number


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# torch's generator states: the CPU one (mt19937) is a fixed-size uint8 tensor, CUDA's (Philox)
# its seed and offset, two 8-byte integers.
_CPU_RNG_BYTES = torch.get_rng_state().numel()
_CUDA_RNG_BYTES = 16


def rng_problem(state: object) -> str | None:
    """What is wrong with a saved rng_state() (one line), or None: checked before any of it is
    applied, as torch.set_rng_state would fail or crash on a state of the wrong shape."""
    if not isinstance(state, dict) or "torch" not in state:
        return "its RNG state is not a dict holding 'torch'"
    for key, t in state.items():
        size = {"torch": _CPU_RNG_BYTES, "cuda": _CUDA_RNG_BYTES}.get(key)
        if size is None:
            return f"its RNG state holds an unknown generator {key!r}"
        if type(t) is not torch.Tensor or t.dtype != torch.uint8 or t.shape != (size,):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"its {key} RNG state is not {size} uint8 bytes (got {got})"
    return None


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


def check_checkpoint(
    path: Path, manifest: dict, *, files: bool = True, rank: int = 0, world_size: int = 1
) -> None:
    """What every loader checks before DCP reads a checkpoint: that every file the manifest
    lists is a regular file, the checksums (`files`; collective under torchrun), the .metadata
    allow-list and the files it names, that every pickled item in the shards is a plain value,
    and every rank's own state. A CheckpointError names the first problem."""
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
    for name in sorted(n for n in listed if _EXTRA_RE.match(n)):
        read_rank_state(Path(path), name)


_EXTRA_RE = re.compile(r"^extra_rank\d+\.pt$")
RANK_STATE_MAX_BYTES = 1 << 30  # RNG states and fp8's amax histories: kilobytes


def read_rank_state(path: Path, name: str) -> tuple[dict, dict | None]:
    """A rank's (RNG state, own state) from its extra_rank{r}.pt, read as plain values and
    checked; CheckpointError naming the file otherwise."""
    from dtrain.checkpoint.safe_load import RefusedObject, load_plain_file

    try:
        saved = load_plain_file(path / name, RANK_STATE_MAX_BYTES)
    except RefusedObject as e:
        raise CheckpointError(
            f"checkpoint {path}: {name} holds more than tensors, refused to unpickle it ({e.what})"
        ) from None
    why = "it is not a dict holding 'rng'" if not isinstance(saved, dict) else None
    why = why or rng_problem(saved.get("rng"))
    rank_state = saved.get("rank") if not why else None
    if not why and rank_state is not None and not isinstance(rank_state, dict):
        why = f"its rank state is a {type(rank_state).__name__}, not a dict"
    if why:
        raise CheckpointError(f"checkpoint {path}: {name} is malformed: {why}")
    return saved["rng"], rank_state or None


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
            if not _plain_name(name):
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


MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists a few files per rank and the run's config
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _plain_name(name: object) -> bool:
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
        if not _plain_name(name):
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


@dataclass
class Saved:
    """A checkpoint complete on disk, and what it cost the training loop."""

    step: int
    path: Path
    background: bool  # written by an async save
    stall_s: float  # the loop was blocked by it: snapshot, staging, waiting for it, committing
    save_s: float  # from the start of the save to its COMPLETE marker
    # Two parts of stall_s: the caller's snapshot (taking the state, checking it finite), and
    # DCP's call on the loop's thread: dcp.save's plan and write (sync), or dcp.async_save's
    # staging to host memory (async: DCP plans in its background thread). None: not measured.
    snapshot_s: float | None = None
    dcp_s: float | None = None
    # An async save: the part of stall_s at the save itself (snapshot, staging, starting the
    # write); the rest is waiting for the write later (the next save, the end of the run).
    at_save_s: float | None = None
    # The first async save on a GPU: the part of at_save_s spent making the pinned host
    # buffers every later save reuses (dtrain.host_staging).
    buffers_s: float | None = None


@dataclass
class _InFlight:
    step: int
    started: float  # time.perf_counter() when the save began (before the state was taken)
    future: Future  # the background write and commit -> (path, finish time), or raises
    stall_s: float  # loop time blocked by this save so far
    snapshot_s: float | None  # Saved.snapshot_s
    dcp_s: float | None  # Saved.dcp_s
    at_save_s: float = 0.0  # Saved.at_save_s
    buffers_s: float | None = None  # Saved.buffers_s


def _storage_writer(partial: Path, step: int, *, keep_host_buffers: bool = False):
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


def _pinned_staging() -> bool:
    """Async saves keep pinned host buffers where there is a GPU to copy from."""
    return torch.cuda.is_available()


# The share of a node's available memory its ranks' pinned staging buffers may take: the rest
# stays for the data loaders, the page cache DCP writes through, and everything else.
HOST_SHARE = 0.7


# A memory cgroup's limit and usage (v2, then v1), read where the process runs in one (a
# container, a Slurm job): MemAvailable is the whole host's.
_CGROUP_MEMORY = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _available_host_bytes() -> int | None:
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
    for limit_file, usage_file in _CGROUP_MEMORY:
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


def _host_bytes(state: dict) -> int:
    """Bytes of this rank's tensors in a state dict (a DTensor: its local shard)."""
    from torch.utils._pytree import tree_leaves

    leaves = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in leaves)


def _synced_hash(path: Path) -> tuple[str, int]:
    """fsync `path` (about free when its writer synced it) and return (sha256, size): the
    manifest only ever vouches for bytes that are on the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return sha256_file(path), path.stat().st_size


class CheckpointManager:
    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 600.0,
    ):
        self.root = Path(run_dir) / "checkpoints"
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._verified: set[Path] = set()  # checked already (find_resumable, trust)
        self.rejected: list[Path] = []  # skipped by find_resumable, newest first
        self.timeout_s = timeout_s  # of the background saves' collectives
        self._in_flight: _InFlight | None = None  # at most one async save at a time
        self._group = None  # the background saves' process group (made at the first one)
        self._executor: ThreadPoolExecutor | None = None
        self._writer = None  # the async saves' one writer (and its host buffers)
        self._async: bool | None = None  # periodic saves in the background (use_async)
        self._host = None  # (state dict, buffer): the pinned buffers before the first async save
        self._buffers_s: float | None = None  # the time making them took
        if cfg.async_save:
            import torch.distributed.checkpoint as dcp

            if not hasattr(dcp, "async_save"):
                raise ConfigError(
                    f"checkpoint.async_save=true needs torch.distributed.checkpoint.async_save "
                    f"(torch >= 2.6); this is torch {torch.__version__}: set "
                    "checkpoint.async_save=false or upgrade torch"
                )

    def use_async(self, state: dict) -> bool:
        """Whether periodic saves are written in the background: checkpoint.async_save, or
        with null (the default) where there is a GPU and torch has DCP's async_save. Decided
        at the first periodic save, on every rank alike (collective). On a GPU that is where
        the pinned host buffers are made (_prepare_host_buffers); where they cannot be, saves
        stay synchronous, said in one warning, with `true` as with null."""
        if self._async is None:
            import torch.distributed.checkpoint as dcp

            wanted = self.cfg.async_save
            if wanted is None:
                wanted = _pinned_staging() and hasattr(dcp, "async_save")
            if wanted and _pinned_staging():
                wanted = self._prepare_host_buffers(state)
            self._async = bool(wanted)
        return self._async

    def _prepare_host_buffers(self, state: dict) -> bool:
        """Make the pinned buffers async saves stage into, where this node's ranks' state fits
        in HOST_SHARE of its available memory; False on every rank if on any it does not, or
        pinning failed there. Collective."""
        need = _host_bytes(state) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        have = _available_host_bytes()
        why = None
        if have is not None and need > HOST_SHARE * have:
            why = (
                f"async saves would pin {need / 1024**3:.2f} GiB of host memory on this node "
                f"(its ranks' state) and {have / 1024**3:.2f} GiB are available (at most "
                f"{int(HOST_SHARE * 100)}% used for them)"
            )
        else:
            try:
                self._pin_host_buffers(state)
            except RuntimeError as e:  # cudaHostRegister refused
                why = f"the host buffers of async saves could not be pinned ({e})"
        whys = ddist.all_gather_object(why) if self.world_size > 1 else [why]
        first = next(((r, w) for r, w in enumerate(whys) if w), None)
        if first is not None:
            self._host = None
            log.warning(
                "checkpoints are written synchronously: %s%s; set checkpoint.async_save=false "
                "to silence this",
                f"rank {first[0]}: " if self.world_size > 1 else "",
                first[1],
            )
            return False
        return True

    def _pin_host_buffers(self, state: dict) -> None:
        t0 = time.perf_counter()
        self._host = host_buffers(state, pin=True)
        self._buffers_s = time.perf_counter() - t0

    def due(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    # --- save --------------------------------------------------------------------------
    # A save is in two halves. This rank's part: DCP's shards, extra_rank{r}.pt, each file
    # fsynced and hashed. Then the commit, collective: the hashes (or errors) gathered, rank 0
    # writes the manifest and COMPLETE and renames the folder, and every rank learns the
    # outcome. save() runs both on the calling thread; save_async() copies the state to host
    # memory and runs both in the background, on a process group of their own.

    @property
    def in_flight(self) -> int | None:
        """The step of the async save being written, if any."""
        return self._in_flight.step if self._in_flight else None

    def save(
        self,
        step: int,
        state: dict,
        manifest: dict,
        *,
        started: float | None = None,
        snapshot_s: float | None = None,
        rank_state: dict | None = None,
    ) -> Saved:
        """Save `state` (DCP state dict) at `step`; returns a Saved. Collective: every rank
        calls it. `started`: when the caller began preparing the save (time.perf_counter()),
        counted in the stall; `snapshot_s`: how much of that went to taking the state;
        `rank_state`: this rank's own (tensors and plain values), kept with its RNG state.

        An OS error on any rank (disk full, read-only or vanished folder) becomes a
        CheckpointSaveError on every rank, after the .partial folder is removed; the
        previous complete checkpoint is untouched. Other exceptions are bugs and propagate.
        """
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter() if started is None else started
        self._check_idle()
        partial, err = self._begin(step)

        dcp_s = None

        def write() -> None:
            nonlocal dcp_s
            faults.point("ckpt.save.after_mkdir", step=step)
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=_storage_writer(partial, step))
            dcp_s = time.perf_counter() - t0

        result = err or self._write_rank_files(step, write, rng_state(), rank_state)
        path = self._commit(step, result, manifest)
        took = time.perf_counter() - started
        return Saved(step, path, False, took, took, snapshot_s=snapshot_s, dcp_s=dcp_s)

    def save_async(
        self,
        step: int,
        state: dict,
        manifest: dict,
        *,
        started: float | None = None,
        snapshot_s: float | None = None,
        rank_state: dict | None = None,
    ) -> None:
        """Start saving `state` at `step` in the background; the loop goes on once the state
        is copied to host memory (DCP's staging). What is saved is this step's: the tensors
        are copied, the RNG state and the manifest (the data position) taken now, and
        `rank_state` must be a host copy (as save()'s). Collective.

        The checkpoint is complete (COMPLETE written, folder renamed) only after every rank's
        files are written and fsynced; poll() or finish() report it, or raise the same
        CheckpointSaveError that save() would.
        """
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter() if started is None else started
        buffers_s = None  # making the host buffers: the first async save only
        self._check_idle()
        partial, err = self._begin(step)
        if err is not None:
            self._commit(step, err, manifest)  # raises, as save() does
        if self._executor is None:
            self._group = ddist.new_background_group(self.timeout_s)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="dtrain-checkpoint")
            pinned = _pinned_staging()
            self._writer = _storage_writer(partial, step, keep_host_buffers=pinned)
            if pinned:  # the writer's cache: one page-locked allocation (use_async made it)
                if self._host is None:  # called without use_async
                    self._pin_host_buffers(state)
                (cache, self._writer.host_buffer), self._host = self._host, None
                self._writer.state_dict_cache = cache
                buffers_s, self._buffers_s = self._buffers_s, None
                log.info(
                    "async checkpoints: %.2f GiB of pinned host memory per rank (made in "
                    "%.1f s) hold the state being written, for the rest of the run",
                    self._writer.host_buffer.numel() / 1024**3,
                    buffers_s,
                )
        self._writer.step = step
        manifest = json.loads(json.dumps(manifest))  # a copy: the position may move on
        rng = rng_state()
        dcp_s = None
        try:
            faults.point("ckpt.save.after_mkdir", step=step)
            t0 = time.perf_counter()
            # One writer for every async save, pointed at this save's folder: its host
            # buffers are free again because the previous save has completed (_check_idle).
            staged = dcp.async_save(
                state,
                checkpoint_id=str(partial),
                storage_writer=self._writer,
                process_group=self._group,
            )
            dcp_s = time.perf_counter() - t0
            # An AsyncSaveResponse where torch stages in the background too (not asked here).
            written = getattr(staged, "upload_completion", staged)
        except OSError as e:  # reported as a failed write, by the commit on every rank
            written = Future()
            written.set_exception(e.with_traceback(None))  # no cycle through this frame

        def finish() -> tuple[Path, float]:
            result = self._write_rank_files(step, written.result, rng, rank_state)
            return self._commit(step, result, manifest, group=self._group), time.perf_counter()

        future = self._executor.submit(finish)
        stall = time.perf_counter() - started
        self._in_flight = _InFlight(
            step, started, future, stall, snapshot_s, dcp_s, stall, buffers_s
        )

    def poll(self, sync_point: bool) -> Saved | None:
        """The async save, if it is complete on every rank (else None, without waiting).
        Ranks must agree on when they take it: under torchrun only at a `sync_point` (every
        rank calls poll at the same steps, and those with True gather a flag), alone at once."""
        job = self._in_flight
        if job is None or (self.world_size > 1 and not sync_point):
            return None
        t0 = time.perf_counter()
        done = job.future.done()
        if self.world_size > 1:
            done = all(ddist.all_gather_object(done))
        job.stall_s += time.perf_counter() - t0
        return self.finish() if done else None

    def finish(self) -> Saved | None:
        """Wait for the async save (if any) to be complete: its Saved, or the
        CheckpointSaveError of its failure. Collective (every rank calls it)."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return None
        t0 = time.perf_counter()
        future, job.future = job.future, None
        try:
            path, done = future.result()
        finally:  # a failure's traceback holds this frame: no cycle back to its future (which
            del future  # would keep the loop's frame, its data loader included, past the exit)
        stall = job.stall_s + time.perf_counter() - t0
        return Saved(
            job.step,
            path,
            background=True,
            stall_s=stall,
            save_s=done - job.started,
            snapshot_s=job.snapshot_s,
            dcp_s=job.dcp_s,
            at_save_s=job.at_save_s,
            buffers_s=job.buffers_s,
        )

    def close(self) -> None:
        """End the background thread. After an error, an async save still in flight is waited
        for, without raising: it completes if every rank's thread gets through it, otherwise
        it stays a .partial folder, never loaded (with a dead peer: within timeout_s)."""
        job, self._in_flight = self._in_flight, None
        failed = job.future.exception() if job is not None else None
        if failed is not None:  # the run's own error is the one reported
            log.warning("checkpoint %s not completed: %s", step_dir_name(job.step), failed)
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self._writer = None  # its pinned host buffers go with it

    def _check_idle(self) -> None:
        # One save at a time: a second would race the first's commit (and its pruning).
        if self._in_flight is not None:
            raise RuntimeError(f"a save of step {self._in_flight.step} is in flight: finish() it")

    def _paths(self, step: int) -> tuple[Path, Path]:
        final = self.root / step_dir_name(step)
        return final, final.with_name(final.name + ".partial")

    def _begin(self, step: int) -> tuple[Path, str | None]:
        """Rank 0 makes an empty .partial folder; every rank gets it, or the error."""
        _, partial = self._paths(step)
        err = None
        if self.rank == 0:
            try:
                faults.point("ckpt.save.begin", step=step)
                self.root.mkdir(parents=True, exist_ok=True)
                _remove_own_dir(partial)  # left by a crash: never part of a complete one
                partial.mkdir()  # fails on anything there: the folder is this save's alone
            except OSError as e:
                err = f"{e}"
        err = ddist.broadcast_object(err)  # also the barrier before anyone writes
        return partial, err

    def _write_rank_files(self, step: int, write, rng: dict, rank_state: dict | None) -> dict | str:
        """This rank's part: `write()` (DCP's shards), then extra_rank{r}.pt; each file
        fsynced and hashed. {name: (sha256, size)}, or one line naming an OS-level failure
        (anything else is a bug, and raises)."""
        from torch.distributed.checkpoint.api import CheckpointException

        _, partial = self._paths(step)
        try:
            write()
            faults.point("ckpt.save.after_dcp", step=step)
            extra_path = partial / f"extra_rank{self.rank}.pt"
            with create_new(extra_path) as f:
                torch.save({"rng": rng, "rank": rank_state or {}}, f)
            faults.point("ckpt.save.after_extra", step=step)
            mine = [extra_path] + sorted(partial.glob(f"__{self.rank}_*.distcp"))
            return {p.name: _synced_hash(p) for p in mine}
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            why = _describe_save_error(e, partial)
            if why is None:
                raise
            return f"{why} (rank {self.rank})" if "(rank " not in why else why

    def _commit(self, step: int, result: dict | str, manifest: dict, group=None) -> Path:
        """The collective half of a save, over `group`: every rank's hashes (or error) to
        rank 0, which writes the manifest, COMPLETE and renames; CheckpointSaveError on every
        rank if any failed, with the .partial folder removed."""
        final, partial = self._paths(step)
        gathered = ddist.all_gather_object(result, group=group)
        err = next((g for g in gathered if isinstance(g, str)), None)
        if self.rank == 0 and err is None:
            try:
                faults.point("ckpt.save.after_hash", step=step)
                files = {}
                for g in gathered:
                    files.update(g)
                if (partial / ".metadata").exists():
                    files[".metadata"] = _synced_hash(partial / ".metadata")
                _fsync_dir(partial)  # the files' names too, before the manifest lists them
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
                _remove_own_dir(final)  # an older save of the same step (e.g. rerun)
                os.replace(partial, final)
                _fsync_dir(self.root)
            except OSError as e:
                err = str(e)
            if err is None:
                faults.point("ckpt.save.after_rename", step=step)
                self._prune()
        err = ddist.broadcast_object(err, group=group)
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
        # A .partial folder here is left by a save that died (saves never overlap, async ones
        # included: this runs in a save's commit, and the next save waits for it): drop it.
        for stale in self.root.glob("step_*.partial"):
            _remove_own_dir(stale, quiet=True)
        for leftover in self.root.glob("step_*.deleting"):
            _remove_own_dir(leftover, quiet=True)
        if self.cfg.keep_last <= 0:
            return
        complete = list_complete(self.root)
        for _, path in complete[: -self.cfg.keep_last]:
            doomed = path.with_name(path.name + ".deleting")
            try:
                _rename_new(path, doomed)
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
        from dtrain.checkpoint.safe_load import read_regular

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
        named = _STEP_RE.match(path.name)
        if named and int(named.group(1)) != step:
            raise CheckpointError(
                f"checkpoint {path}: {MANIFEST} says step {step} but the folder is {path.name}"
            )
        return manifest

    def _check(self, path: Path, manifest: dict) -> None:
        rank, world = self.rank, self.world_size
        check_checkpoint(path, manifest, files=self.cfg.verify, rank=rank, world_size=world)

    def load(self, path: Path, state: dict) -> Loaded:
        """Load into `state` (a DCP state dict template) in place and restore this rank's RNG
        state; return the manifest and a rank's own state (save()'s `rank_state`): this
        rank's, or where the checkpoint was saved by another number of ranks, that of this
        rank modulo theirs (its RNG state is then not restored: it would repeat that rank's
        draws). None where the checkpoint has none (a dtrain that kept only RNG states)."""
        from dtrain.checkpoint.safe_load import load_into

        path = Path(path)
        manifest = self.read_manifest(path)
        if path not in self._verified:
            self._check(path, manifest)
        load_into(path, state, manifest["files"])
        saved_world = manifest.get("world_size")
        same = saved_world == self.world_size
        if not same and saved_world is None:
            return Loaded(manifest, None, None)
        source = self.rank if same else self.rank % saved_world
        extra = f"extra_rank{source}.pt"
        if extra not in manifest["files"]:  # only files the manifest vouches for are read
            return Loaded(manifest, None, None)
        rng, rank_state = read_rank_state(path, extra)
        if same:
            set_rng_state(rng)
        return Loaded(manifest, rank_state, None if same else source)

    def trust(self, path: Path) -> None:
        """Count `path` as verified, e.g. by rank 0's find_resumable: load() does not hash it
        again (checkpoint.verify reads every byte, which is minutes for a large model)."""
        self._verified.add(Path(path))

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
                if file_kind(path / MARKER) == "missing":  # read_manifest's advice: resume=PATH
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
            self.trust(path)
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
            while os.path.lexists(target):
                n += 1
                target = path.with_name(f"{path.name}.rejected{n}")
            try:
                _rename_new(path, target)
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
                _rename_new(path, doomed)
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
