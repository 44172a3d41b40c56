"""A step that runs long says so: the first step compiles (torch.compile, DeepCompile) and can
take minutes, which a user would otherwise watch in silence. `SlowSteps` knows which steps those
are (the strategy's plan), `SlowStepNotice` says it while one runs."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtrain.strategies.base import Strategy

log = logging.getLogger("dtrain")


class SlowSteps:
    """The loop steps of this process that run long, each with what it does (the strategy's
    `slow_steps`), asked for step by step. The plan moves at its compiling step if the
    strategy's step mode still runs that step eagerly: fp8's first step found a non-finite
    amax, so its scales were reset and the step after it is dynamic too, eager again, and the
    model compiles a step later than planned. `step in slow_steps`: a step that runs long
    (the collector runs after each: dtrain/run/gc_schedule.py)."""

    def __init__(self, strategy: Strategy, first_step: int):
        self.strategy = strategy
        self.steps: dict[int, str] = strategy.slow_steps(first_step)
        self.compiling_at: int = strategy.compiling_step(first_step)

    def what(self, step: int) -> str | None:
        """What `step`, about to run, does that takes long, or None: asked before it runs."""
        if step == self.compiling_at and self.strategy.compiling_step(step) != step:
            self._move(step)
        return self.steps.get(step)

    def _move(self, step: int) -> None:
        """`step` runs eagerly too: the strategy's plan from it up to its new compiling step;
        what the old plan had later stays where it was (DeepSpeed's second compile counts
        from the process's first step, not from this one)."""
        self.compiling_at = self.strategy.compiling_step(step)
        moved = self.strategy.slow_steps(step).items()
        later = {k: v for k, v in self.steps.items() if k > self.compiling_at}
        self.steps = later | {k: v for k, v in moved if k <= self.compiling_at}
        log.info(
            "step %d runs eagerly as well: the step before found a non-finite amax and fp8's "
            "scales were reset; step %d compiles the model",
            step,
            self.compiling_at,
        )

    def __contains__(self, step: int) -> bool:
        return step in self.steps


class SlowStepNotice:
    """While armed, logs after `after_s` and then every `every_s` that the step is still
    running, with `what` it is doing. A daemon thread: it never holds the process."""

    def __init__(self, step: int, what: str | None, after_s: float = 20.0, every_s: float = 60.0):
        self.step, self.what = step, what
        self.after_s, self.every_s = after_s, every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SlowStepNotice:
        if self.what is not None:
            self._t0 = time.perf_counter()
            self._thread = threading.Thread(
                target=self._watch, name="dtrain-slow-step", daemon=True
            )
            self._thread.start()
        return self

    def _watch(self) -> None:
        wait = self.after_s
        while not self._done.wait(wait):
            elapsed = time.perf_counter() - self._t0
            log.info("step %d still running after %.0f s: %s", self.step, elapsed, self.what)
            wait = self.every_s

    def __enter__(self) -> SlowStepNotice:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """The step is done (cheap to call again); no line is logged after this returns."""
        if self._thread is not None:
            self._done.set()
            self._thread.join(timeout=5.0)  # at most a log line in progress
            self._thread = None
