"""What torch.compile's caches gave the compiling step: a second run of the same config reuses
the graphs the first compiled (Inductor's FX graph cache and AOTAutograd's cache, on by default,
under TORCHINDUCTOR_CACHE_DIR), and the log says so in one line."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("dtrain")

_KEYS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"))


@dataclass(frozen=True)
class CacheCounts:
    hits: int
    misses: int


def counts() -> CacheCounts:
    """Inductor's graph-cache hits and misses so far in this process."""
    from torch._dynamo.utils import counters

    hit, miss = (int(counters[group][key]) for group, key in _KEYS)
    return CacheCounts(hit, miss)


def cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


def describe(before: CacheCounts, after: CacheCounts, step: int, seconds: float) -> str | None:
    """One line on the compiling step: how many of its graphs came from the cache; None where
    it compiled no graph (an eager run, or graphs compiled at an earlier step)."""
    hits, misses = after.hits - before.hits, after.misses - before.misses
    if hits + misses == 0:
        return None
    where = cache_dir()
    if misses == 0:
        return (
            f"torch.compile: step {step} took {seconds:.0f} s; all {hits} graphs came from the "
            f"compile cache ({where})"
        )
    if hits == 0:
        return (
            f"torch.compile: step {step} took {seconds:.0f} s and compiled {misses} graphs; a "
            f"second run of this config reuses them from {where}"
        )
    return (
        f"torch.compile: step {step} took {seconds:.0f} s; {hits} of {hits + misses} graphs "
        f"came from the compile cache ({where})"
    )


class CompileCacheNote:
    """Around the compiling step: afterwards, where `active`, logs `describe`'s line."""

    def __init__(self, step: int, active: bool):
        self.step, self.active = step, active

    def __enter__(self) -> CompileCacheNote:
        if self.active:
            self.before, self.t0 = counts(), time.perf_counter()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.active and exc_type is None:
            said = describe(self.before, counts(), self.step, time.perf_counter() - self.t0)
            if said:
                log.info(said)
