"""Fault injection for the reliability suite (tests/faults/, docs/reliability.md).

Injection points live in the code paths they test and cost one dict lookup when unused:

    faults.point("ckpt.save.after_dcp", step=step)

does nothing unless the environment variable DTRAIN_FAULT names that point:

    DTRAIN_FAULT="ckpt.save.after_dcp=kill@1"     SIGKILL rank 1 when it gets there
    DTRAIN_FAULT="ckpt.save.begin=enospc#4"       raise OSError(ENOSPC) in the save of step 4
    DTRAIN_FAULT="train.step=stop@1#3"            SIGSTOP rank 1 at step 3 (a hung rank)
    DTRAIN_FAULT="train.step=kill@1#5%0"          SIGKILL rank 1 at step 5, first attempt only
    DTRAIN_FAULT="ckpt.save.write=sleep#4"        the save of step 4 waits DTRAIN_FAULT_SLEEP_S
                                                  (default 5) before DCP writes its shards

`%<attempt>` fires only on that torchrun restart attempt (TORCHELASTIC_RESTART_COUNT, 0 on the
first run), so an elastic restart that replays the same steps does not fail again.

Grammar: `<point>=<action>[@<rank>][#<step>][%<attempt>]`, several joined by commas.
Actions: kill, stop (signals to this process), enospc, eacces, erofs, eio (an OSError as the
OS would raise it), sleep (a slow disk, in the thread that reaches the point), oom (the
torch.OutOfMemoryError a CUDA allocation raises, on any device).
An environment variable rather than a config key, so that a kill point can sit anywhere
(including below the config) and a test can arm one rank of a torchrun job.

Config-driven injection for the loop (`debug.inject_nonfinite_at_step`) is NonfiniteInjector.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

ENV = "DTRAIN_FAULT"

# Every point in the code, so a test (and the docs) can list them and a typo fails loudly.
POINTS = (
    "ckpt.save.begin",  # before the .partial folder exists
    "ckpt.save.after_mkdir",  # .partial exists, nothing written
    "ckpt.save.write",  # DCP about to write this rank's shards (its own thread in an async save)
    "ckpt.save.after_dcp",  # model/optimizer shards and .metadata written
    "ckpt.save.after_extra",  # extra_rank{r}.pt written
    "ckpt.save.after_hash",  # every rank hashed its files, manifest not yet written
    "ckpt.save.after_manifest",  # manifest.json written, no COMPLETE marker
    "ckpt.save.after_marker",  # COMPLETE written, still named .partial
    "ckpt.save.after_rename",  # renamed to step_NNNNNNN, older ones not yet pruned
    "ckpt.prune",  # an old checkpoint renamed to .deleting, not yet removed
    "train.step",  # start of an optimizer step
)
ACTIONS = ("kill", "stop", "sleep", "oom", "enospc", "eacces", "erofs", "eio")
SLEEP_ENV = "DTRAIN_FAULT_SLEEP_S"
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
        elif f.action == "sleep":
            time.sleep(float(os.environ.get(SLEEP_ENV, "5")))
        elif f.action == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {ENV} at {name})")
        else:
            code = _ERRNO[f.action]
            raise OSError(code, f"{os.strerror(code)} (injected by {ENV} at {name})")


class NonfiniteInjector:
    """debug.inject_nonfinite_at_step: the model's loss becomes NaN at one step.

    A forward hook on the plain module, so every strategy's wrapper (DDP, FSDP, compile)
    sees the NaN flow through its own backward, exactly as a real overflow would: injected
    on one rank only, DDP's all-reduce spreads it, which is what the skip must survive.
    """

    def __init__(self, module: torch.nn.Module, at_step: int, rank: int | None, my_rank: int):
        self.at_step, self.armed = at_step, False
        self.handle = None
        if rank is None or rank == my_rank:
            self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.armed and isinstance(output, torch.Tensor) and output.dim() == 0:
            return output * float("nan")
        return output

    def before_step(self, step: int) -> None:
        """`step` is the 1-based number of the step about to run."""
        self.armed = step == self.at_step

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
