"""Fault injection for tests: kill (or stop, or fail) one rank at a named point of a chosen step.

The grammar and the points are shared with the reliability suite (docs/reliability.md); this
module adds what elastic-restart tests need on top: `%<attempt>` fires only on that torchrun
restart attempt (TORCHELASTIC_RESTART_COUNT, 0 on the first run), so the restarted group, which
replays the same steps, does not fail again.

    faults.point("ckpt.save.after_dcp", step=step)

does nothing unless the environment variable DTRAIN_FAULT names that point:

    DTRAIN_FAULT="train.step=kill@1#5%0"         SIGKILL rank 1 as step 5 starts, first run only
    DTRAIN_FAULT="ckpt.save.after_dcp=kill@0#4"  SIGKILL rank 0 mid-save of step 4 (shards on disk,
                                                 checkpoint not complete)

Grammar: `<point>=<action>[@<rank>][#<step>][%<attempt>]`, several joined by commas. Actions:
kill, stop (signals to this process), enospc, eacces, erofs, eio (an OSError as the OS would
raise it). An environment variable rather than a config key, so a test can arm one rank of a
torchrun job and the point can sit below the config.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from dataclasses import dataclass

ENV = "DTRAIN_FAULT"

# Every point in the code, so a test (and the docs) can list them and a typo fails loudly.
POINTS = (
    "ckpt.save.after_dcp",  # model/optimizer shards and .metadata written, not yet complete
    "ckpt.save.after_hash",  # every rank hashed its files, manifest not yet written (rank 0)
    "train.step",  # start of an optimizer step (`step` is the 1-based step about to run)
)
ACTIONS = ("kill", "stop", "enospc", "eacces", "erofs", "eio")
_ERRNO = {"enospc": errno.ENOSPC, "eacces": errno.EACCES, "erofs": errno.EROFS, "eio": errno.EIO}


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    rank: int | None = None
    step: int | None = None
    attempt: int | None = None


def parse(spec: str) -> list[Fault]:
    """DTRAIN_FAULT's value -> faults; a malformed spec is a bug in the test, so it raises."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, rest = item.partition("=")
        step = rank = attempt = None
        if "%" in rest:
            rest, _, a = rest.partition("%")
            attempt = int(a)
        if "#" in rest:
            rest, _, s = rest.partition("#")
            step = int(s)
        if "@" in rest:
            rest, _, r = rest.partition("@")
            rank = int(r)
        if point not in POINTS or rest not in ACTIONS:
            raise ValueError(
                f"{ENV}: bad item {item!r}; points: {', '.join(POINTS)}; actions: "
                f"{', '.join(ACTIONS)}"
            )
        out.append(Fault(point, rest, rank, step, attempt))
    return out


def restart_attempt() -> int:
    """Which attempt of the worker group this is: torchrun counts restarts from 0."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


_cache: tuple[str, list[Fault]] = ("", [])


def _armed() -> list[Fault]:
    global _cache
    spec = os.environ.get(ENV, "")
    if spec != _cache[0]:
        _cache = (spec, parse(spec))
    return _cache[1]


def point(name: str, *, step: int | None = None) -> None:
    """An injection point: fire the fault DTRAIN_FAULT arms here for this rank (and step)."""
    faults = _armed()
    if not faults:
        return
    rank = int(os.environ.get("RANK", "0"))
    for f in faults:
        if f.point != name or (f.rank is not None and f.rank != rank):
            continue
        if f.step is not None and f.step != step:
            continue
        if f.attempt is not None and f.attempt != restart_attempt():
            continue
        print(f"{ENV}: {f.action} rank {rank} at {name}, step {step}", file=sys.stderr, flush=True)
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            code = _ERRNO[f.action]
            raise OSError(code, f"{os.strerror(code)} (injected by {ENV} at {name})")
