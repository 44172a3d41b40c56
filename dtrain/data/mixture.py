"""Weighted mixtures: which source each block of the global order comes from.

Every source is cut into the same S streams (stream.py), and block k of the global order is the
next block of stream k % S of source `Mixture.source_of(k)` (loader.py gives it to rank k % R).
The choice is a pure function of (seed, k): the blocks are cut into chunks of CHUNK, chunk c
holds each source's count by cumulative rounding of c * CHUNK * weight (so whole chunks are
within one block of the weights) in an order permuted by a generator seeded by (seed, c). A
resume needs only each stream's position, at any world size, since every rank computes the same
choices for the blocks it takes, and the ranks reading stream index s read it of every source.

A source whose stream s ends (data.on_exhausted=reweight) hands the blocks that stream would
have made to the other sources of stream s, by a second draw of the chunk's generator over the
remaining weights: the choice then depends on (seed, k, which streams of s ended), which every
rank reading s sees alike, and again after a resume.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

from dtrain.data.stream import StreamSpec
from dtrain.data.stream import stream_blocks as _stream_blocks
from dtrain.errors import DataError

log = logging.getLogger("dtrain")


class SourceEnded(DataError):
    """A source ran out under data.on_exhausted=stop: the blocks read before it still count."""


CHUNK = 1024  # blocks whose source counts hold the weights exactly (to rounding)


@dataclass(frozen=True)
class Mixture:
    names: tuple[str, ...]
    weights: tuple[float, ...]  # normalised: they sum to 1
    seed: int

    @classmethod
    def of(cls, weights: dict[str, float], seed: int) -> Mixture:
        total = sum(weights.values())
        return cls(tuple(weights), tuple(w / total for w in weights.values()), seed)

    def source_of(self, k: int, ended: frozenset[int] = frozenset()) -> int:
        """The source of block k of the global order, given the sources whose stream ended."""
        if len(self.names) == 1:
            return 0 if not ended else -1
        order, draws = _chunk(self.seed, self.weights, k // CHUNK)
        m = int(order[k % CHUNK])
        if m not in ended:
            return m
        rest = [i for i in range(len(self.names)) if i not in ended]
        if not rest:
            return -1
        total = sum(self.weights[i] for i in rest)
        acc, u = 0.0, float(draws[k % CHUNK]) * total
        for i in rest:
            acc += self.weights[i]
            if u < acc:
                return i
        return rest[-1]


@functools.lru_cache(maxsize=64)
def _chunk(seed: int, weights: tuple[float, ...], c: int):
    """Chunk c's sources in their order, and one uniform draw per block for re-weighting."""
    import numpy as np

    cum = np.cumsum((0.0, *weights))
    cum[-1] = 1.0  # so that every chunk holds exactly CHUNK blocks
    counts = np.diff(np.rint(cum * (c + 1) * CHUNK)) - np.diff(np.rint(cum * c * CHUNK))
    order = np.repeat(np.arange(len(weights)), counts.astype(np.int64))
    rng = np.random.default_rng([seed % 2**63, c])
    return rng.permutation(order), rng.random(CHUNK)


@dataclass(frozen=True)
class GroupSpec:
    """Stream index s of every source: what a DataLoader worker needs to read it (picklable)."""

    specs: tuple[StreamSpec, ...]  # one per source, all cut into the same number of streams
    mix: Mixture
    on_exhausted: str  # repeat | reweight | stop

    @property
    def n_streams(self) -> int:
        return self.specs[0].n_streams


def group_blocks(
    g: GroupSpec, s: int, states: dict[int, dict], *, k0: int, rank: int, world: int
) -> Iterator[tuple]:
    """The blocks of stream index s in the global order from block k0 (k0 % S == s), read from
    the source each one comes from; yields (k, source, block, position after it with its k,
    skip counts, notes) for the blocks this rank keeps (k % world == rank). The records skipped
    before a block are counted by the rank that keeps it, so once over the ranks that share a
    stream; the notes say once that a source started another epoch or ran out."""
    repeat = g.on_exhausted == "repeat"
    gens = [
        _stream_blocks(replace(spec, repeat=repeat), s, states[m]) for m, spec in enumerate(g.specs)
    ]
    ended: set[int] = set()
    said: set[tuple[int, str]] = set()
    notes: list[tuple[str, str]] = []
    k = k0
    while True:
        m = g.mix.source_of(k, frozenset(ended))
        if m < 0:
            raise DataError(
                f"the data ran out: stream {s} of every source is read to its end "
                "(data.on_exhausted=reweight); train fewer steps, add data, or set "
                "data.on_exhausted=repeat"
            )
        try:
            blk, pos, sk = next(gens[m])
        except StopIteration:
            if g.on_exhausted == "stop":
                raise SourceEnded(
                    f"data source '{g.mix.names[m]}' ran out (data.on_exhausted=stop); the "
                    "last checkpoint resumes with more data, or set data.on_exhausted=repeat "
                    "or reweight"
                ) from None
            ended.add(m)
            notes.append((g.mix.names[m], "ran out"))
            continue
        if pos["epoch"] > 0 and m not in said:
            said.add(m)
            notes.append((g.mix.names[m], "epoch"))
        if k % world == rank:  # the records skipped before a block: its rank counts them
            yield k, m, blk, {**pos, "k": k}, sk, notes
            notes = []
        k += g.n_streams


def say_note(name: str, what: str, weights: dict[str, float]) -> None:
    """One log line for a source that started another epoch or ran out."""
    if what == "epoch":
        log.info("data source '%s' has been read whole: it starts another epoch", name)
        return
    rest = [n for n in weights if n != name]
    log.warning(
        "data source '%s' ran out on a stream of this rank; its share goes to %s by their "
        "weights (data.on_exhausted=reweight)",
        name,
        ", ".join(f"'{n}'" for n in rest) or "no other source",
    )
