"""One run per run dir: an exclusive lock on `<run_dir>/.lock`, held for the run's life.

Two runs writing one run dir interleave metrics.jsonl and race on each other's checkpoint
folders. So one process of a run holds flock(2) on the lock file from before Hydra writes
anything until it exits; the kernel drops the lock when that process dies, however it dies,
so the lock of a dead run is stale by construction and the next run simply takes it. The
file names its holder (host, pid, job, start time, command) for the message a second run
prints; that run exits 2 and touches nothing.

Under torchrun one process locks for the whole job: global rank 0. The other ranks wait
until the lock file names their own job (torchrun's run id and rendezvous endpoint, the same
in every rank of a job), and exit 2 naming the holder if it names another job for longer
than WAIT_S.

A run refused for bad input (a UserError) before its first step leaves the run dir as it
found it: rank 0 notes what was there when it took the lock, and undo_refused() removes what
the run added since (the whole dir if it made it), puts back .hydra/ and cuts appended files
back to their length. A symbolic link anywhere in the run dir is refused before anything is
written (dtrain/reliability/safe_write.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.errors import ConfigError, UserError
from dtrain.reliability.safe_write import check_tree

LOCK = ".lock"
WAIT_S = 120.0  # how long a non-zero rank waits for rank 0 to take the lock for their job

_held: dict[Path, int] = {}  # run dir -> fd of the lock this process holds


@dataclass
class _Before:
    """The run dir as rank 0 found it, until the run's first step (then forgotten)."""

    existed: bool
    sizes: dict[str, int] = field(default_factory=dict)  # relative path -> bytes (files)
    dirs: set[str] = field(default_factory=set)
    hydra: dict[str, bytes] = field(default_factory=dict)  # .hydra/ files, to put back


_before: dict[Path, _Before] = {}
KEEP = "checkpoints"  # a refused run never removes from here (resume=auto sets bad ones aside)


def _note(run_dir: Path) -> _Before:
    if not run_dir.is_dir():
        return _Before(existed=False)
    b = _Before(existed=True)
    for dirpath, dirnames, filenames in os.walk(run_dir):
        rel = Path(dirpath).relative_to(run_dir)
        if rel.parts[:1] == (KEEP,):
            continue
        b.dirs.update(str(rel / d) for d in dirnames)
        for f in filenames:
            p = Path(dirpath) / f
            with contextlib.suppress(OSError):
                b.sizes[str(rel / f)] = p.stat().st_size
                if rel.parts[:1] == (".hydra",):
                    b.hydra[str(rel / f)] = p.read_bytes()
    return b


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file, and would keep the
    # lock alive after its parent died; exec'd children never get it (os.open is CLOEXEC).
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _job() -> str:
    """What every rank of one torchrun job shares, and no other job does. Not the restart
    count: each agent counts its own, and a replacement node's agent starts again at 0."""
    env = os.environ
    return "{}@{}:{}".format(
        env.get("TORCHELASTIC_RUN_ID", "-"),
        env.get("MASTER_ADDR", "-"),
        env.get("MASTER_PORT", "-"),
    )


def _key(run_dir: str | Path) -> Path:
    # abspath, not Path.absolute(): Hydra's run dir has its `..` folded, launch/train.py's not.
    return Path(os.path.abspath(os.fspath(run_dir)))


def _is_locker() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _holder(path: Path) -> dict:
    try:
        value = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _describe(run_dir: Path, holder: dict) -> str:
    who = (
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
        f"{holder.get('started', '?')}: {holder.get('command', '?')}"
        if holder
        else "another process"
    )
    return (
        f"run dir {run_dir} is in use by another run ({who}); wait for it to end, stop it, "
        "or choose another hydra.run.dir"
    )


def acquire(run_dir: str | Path) -> bool:
    """Take the run dir for this process (rank 0) or check it is this job's (other ranks).

    Returns True if this call took a lock that release() must give back; ConfigError if
    another live run holds the dir. Creates only the run dir and its lock file.
    """
    run_dir = _key(run_dir)
    if run_dir in _held:
        return False
    path = run_dir / LOCK
    if not _is_locker():
        _wait_for_job(run_dir, path)
        return False
    check_tree(run_dir)
    before = _note(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # teammates may resume the run; O_NOFOLLOW: a link planted at .lock is never written
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        raise ConfigError(f"run dir {run_dir}: cannot open its lock file {path} ({e})") from None
    try:
        _lock(fd, path, run_dir)
    except BaseException:
        os.close(fd)
        raise
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": _job(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv)[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    _held[run_dir] = fd
    _before[run_dir] = before
    return True


def mark_started(run_dir: str | Path) -> None:
    """The run trained a step: what it wrote from now on is its own and stays."""
    _before.pop(_key(run_dir), None)


def undo_refused(run_dir: str | Path | None = None) -> None:
    """Remove what a run refused before its first step added to its run dir (every run dir
    this process noted, if None); nothing that was there before is removed."""
    for key in [_key(run_dir)] if run_dir is not None else list(_before):
        b = _before.pop(key, None)
        if b is None or not key.is_dir():
            continue
        if not b.existed:
            shutil.rmtree(key, ignore_errors=True)
            continue
        _restore(key, b)


def _restore(run_dir: Path, b: _Before) -> None:
    for dirpath, dirnames, filenames in os.walk(run_dir, topdown=True):
        rel = Path(dirpath).relative_to(run_dir)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d != KEEP]
        for d in list(dirnames):
            if str(rel / d) not in b.dirs:
                dirnames.remove(d)
                shutil.rmtree(Path(dirpath) / d, ignore_errors=True)
        for f in filenames:
            name, p = str(rel / f), Path(dirpath) / f
            with contextlib.suppress(OSError):
                if name not in b.sizes:
                    p.unlink()
                elif name in b.hydra:
                    if p.read_bytes() != b.hydra[name]:
                        p.write_bytes(b.hydra[name])
                elif p.stat().st_size > b.sizes[name]:  # appended to (metrics.jsonl)
                    os.truncate(p, b.sizes[name])


def _lock(fd: int, path: Path, run_dir: Path) -> None:
    """flock, waiting up to WAIT_S only for a holder of this same torchrun job (the previous
    attempt's rank 0 of an elastic restart may still be saving)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _holder(path)
            same_job = os.environ.get("TORCHELASTIC_RUN_ID") and holder.get("job") == _job()
            if not same_job or time.monotonic() > deadline:
                raise ConfigError(_describe(run_dir, holder)) from None
            time.sleep(0.5)
        except OSError as e:  # ENOSYS, EOPNOTSUPP, ENOLCK: a file system without locks
            raise ConfigError(
                f"run dir {run_dir}: its file system cannot lock {path} ({e}); mount it with "
                "locking (e.g. Lustre's -o flock) or choose another hydra.run.dir"
            ) from None


def _wait_for_job(run_dir: Path, path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if _holder(path).get("job") == _job():
            return
        time.sleep(0.2)
    err = ConfigError(
        _describe(run_dir, _holder(path)).replace(
            "; wait for it",
            " (or rank 0 never took it: is the run dir on a file system every "
            "node shares?); wait for it",
            1,
        )
    )
    err.every_rank = True  # rank 0 may be fine: this rank must say why it stops
    raise err


def release(run_dir: str | Path) -> None:
    fd = _held.pop(_key(run_dir), None)
    if fd is not None:
        # Emptied, then unlocked: a run that ended leaves the run dir as it found it; only a
        # run that died leaves its name behind (the next run takes the stale lock anyway).
        os.ftruncate(fd, 0)
        os.close(fd)


@contextlib.contextmanager
def hold_run_dir(run_dir: str | Path):
    """The run dir is this run's for the duration (a no-op if this process holds it already,
    e.g. launch/train.py took it before Hydra wrote anything). A refusal for bad input before
    the first step leaves the run dir as it was."""
    took = acquire(run_dir)
    try:
        yield
    except UserError:
        undo_refused(run_dir)
        raise
    finally:
        if took:
            release(run_dir)
