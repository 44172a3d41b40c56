"""Python's garbage collector during training: when it runs, and how long it pauses the loop.

Left automatic, the collector runs whenever enough objects have been allocated, and a step
allocates many (FSDP2's DTensors, torchao's fp8 tensor subclasses, autograd nodes): a
collection of the old generation walks every object the process holds (the compiled graphs'
modules among them) and pauses that rank for tens of milliseconds, at a different step on each
rank, and the others wait for it at the next collective. So, as torchtitan (`gc_freq`), OLMo-core
and Composer do, the automatic collector is off while the loop runs, and every `every` steps
each rank collects the young generations (gc.collect(1)), all at the same step, and once
after the process's first step and after each of the strategy's slow steps (`compiling`,
dtrain/run/slow_step.py: the step that compiles, the first or a later one where fp8's first
steps run eagerly, and those eager steps): torch.compile leaves garbage in reference
cycles (hundreds of thousands of objects on a cold cache, host memory only) that would
otherwise wait for step `every`. What is collected, automatic or scheduled, is timed: the
loop logs its share of the wall time (perf/gc_pct).

What survives a young collection moves to the oldest generation, which is not collected while
the loop runs (as with torchtitan's gc_freq): garbage that forms a cycle only later stays until
the loop ends. DataLoader workers, forked while the collector is off, turn it back on, and
are forked with the parent's objects frozen so that they never collect its garbage
(dtrain/data/loader.py).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Container


class GcSchedule:
    """Context manager around the step loop. every=0: Python's automatic collection, timed."""

    def __init__(self, every: int, compiling: Container[int] = ()):
        self.every = every
        # the slow steps, the compiling one among them (asked as each ends: the plan can move)
        self.compiling = compiling
        self.pause_s = 0.0  # time in collections since the last take()
        self._t0: float | None = None
        self._was_enabled = True
        self._first: int | None = None  # the process's first step (after a resume, not 1)

    def __enter__(self) -> GcSchedule:
        self._was_enabled = gc.isenabled()
        gc.callbacks.append(self._timed)
        if self.every > 0:
            gc.collect(1)  # start the loop with the set-up's young garbage gone
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._timed)
        if self._was_enabled:
            gc.enable()

    def step_done(self, step: int) -> None:
        if self._first is None:
            self._first = step
        # The same steps on every rank: the same global step, each rank's first, and the
        # compiling steps (every rank compiles at the same ones).
        if self.every > 0 and (
            step % self.every == 0 or step == self._first or step in self.compiling
        ):
            gc.collect(1)

    def take(self) -> float:
        """Seconds spent collecting since the last call."""
        paused, self.pause_s = self.pause_s, 0.0
        return paused

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pause_s += time.perf_counter() - self._t0
            self._t0 = None
