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
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from dtrain.errors import ConfigError

LOCK = ".lock"
WAIT_S = 120.0  # how long a non-zero rank waits for rank 0 to take the lock for their job

_held: dict[Path, int] = {}  # run dir -> fd of the lock this process holds


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file, and would keep the
    # lock alive after its parent died; exec'd children never get it (os.open is CLOEXEC).
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _job() -> str:
    """What every rank of one torchrun job (one attempt) shares, and no other job does."""
    env = os.environ
    return "{}@{}:{}#{}".format(
        env.get("TORCHELASTIC_RUN_ID", "-"),
        env.get("MASTER_ADDR", "-"),
        env.get("MASTER_PORT", "-"),
        env.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )


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
    run_dir = Path(run_dir).absolute()
    if run_dir in _held:
        return False
    path = run_dir / LOCK
    if not _is_locker():
        _wait_for_job(run_dir, path)
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(_describe(run_dir, _holder(path))) from None
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
    return True


def _wait_for_job(run_dir: Path, path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if _holder(path).get("job") == _job():
            return
        time.sleep(0.2)
    raise ConfigError(_describe(run_dir, _holder(path)))


def release(run_dir: str | Path) -> None:
    fd = _held.pop(Path(run_dir).absolute(), None)
    if fd is not None:
        # Emptied, then unlocked: a run that ended leaves the run dir as it found it; only a
        # run that died leaves its name behind (the next run takes the stale lock anyway).
        os.ftruncate(fd, 0)
        os.close(fd)


@contextlib.contextmanager
def hold_run_dir(run_dir: str | Path):
    """The run dir is this run's for the duration (a no-op if this process holds it already,
    e.g. launch/train.py took it before Hydra wrote anything)."""
    took = acquire(run_dir)
    try:
        yield
    finally:
        if took:
            release(run_dir)
