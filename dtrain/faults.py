"""Deterministic fault injection: make one rank die (or hang) at a chosen point of a chosen step.

Tests of elastic restarts need a failure that happens at a known place, once. The loop and the
checkpoint writer call `hit(point, step)` at the named points below; when the `debug.fault_*`
keys select that point, step, global rank and torchrun restart attempt, the process acts:

    kill   SIGKILL itself, as the OOM killer or a lost node would (no cleanup, no Python exit)
    hang   stop making progress forever (for tests of collective timeouts)

Points:
    train.step        after the optimizer step of `step`, before its checkpoint
    checkpoint.save   inside the save of `step`, after this rank's shards are on disk and before
                      the checkpoint is marked complete

`debug.fault_attempt` matches torchrun's TORCHELASTIC_RESTART_COUNT (0 on the first attempt), so
the restarted group, which replays the same steps, does not fail again.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

POINTS = ("train.step", "checkpoint.save")
ACTIONS = ("kill", "hang")


@dataclass(frozen=True)
class FaultPlan:
    point: str
    step: int
    rank: int
    attempt: int
    action: str


_plan: FaultPlan | None = None
_rank: int = 0


def restart_attempt() -> int:
    """Which attempt of the worker group this is: torchrun counts restarts from 0."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def plan_from(debug) -> FaultPlan | None:
    """The plan the `debug.fault_*` keys (a config.DebugConfig) describe; None when off."""
    if debug.fault_at_step is None:
        return None
    return FaultPlan(
        point=debug.fault_point,
        step=debug.fault_at_step,
        rank=debug.fault_rank,
        attempt=debug.fault_attempt,
        action=debug.fault_action,
    )


def configure(plan: FaultPlan | None, rank: int) -> None:
    """Arm (or, with None, disarm) the fault for this process; `rank` is its global rank."""
    global _plan, _rank
    _plan, _rank = plan, rank


def hit(point: str, step: int) -> None:
    """Called at each fault point; acts only where the armed plan matches exactly."""
    p = _plan
    if p is None or p.point != point or p.step != step or p.rank != _rank:
        return
    if restart_attempt() != p.attempt:
        return
    print(
        f"debug: fault '{p.action}' on rank {_rank} (pid {os.getpid()}) at {point} of step "
        f"{step}, restart attempt {p.attempt}",
        file=sys.stderr,
        flush=True,
    )
    if p.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: alive, but never reaching the next collective
        time.sleep(3600)
