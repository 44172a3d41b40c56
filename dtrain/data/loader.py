"""This rank's batches: streams read by (rank, worker), a global order, an exact position.

Every source is cut into S = data.num_streams streams (stream.py). Blocks have a global order
that does not depend on the number of ranks or workers: block k is the next block of stream
k % S of the source chosen for k (mixture.py; one source: always it), and step n trains on
blocks [n*G, (n+1)*G) of it (G = the global batch). Rank r of a world of size R takes the
blocks k with k % R == r, so it reads the stream indices s with s % g == r % g (g = gcd(S, R))
of every source and keeps every (R/g)-th block of each: when R divides S a rank owns whole
streams and reads each record once; otherwise R/g ranks read a stream and each keeps its
share. Its DataLoader workers split its stream indices between them. Hence:
  * each block is trained on by exactly one (rank, worker), once per epoch of its stream;
  * a step sees the same blocks with 1 rank x micro 8 as with 2 or 3 ranks (parity);
  * the position is the global count of blocks consumed plus each stream's small state,
    taken from the rank that took the stream's latest block; resuming rebuilds every
    stream at its state, so the next batch is the one an uninterrupted run would have seen,
    with any number of workers and any world size.
Workers run ahead (prefetch); each block carries its stream's state after it, and the state
that is saved is the one of the last block the loop actually took.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from math import gcd
from typing import NamedTuple

import torch

from dtrain.data.mixture import GroupSpec, SourceEnded, group_blocks, say_note
from dtrain.data.stream import SKIP_KINDS, StreamSpec, classify, is_heldout, start_state
from dtrain.errors import DataError
from dtrain.reliability.preemption import ignore_stop_signals

log = logging.getLogger("dtrain")


def _worker_init(worker_id: int) -> None:
    """What each DataLoader worker runs first: stopping is left to its rank, and Python's
    garbage collector is on. A worker forks while the loop has the collector off
    (dtrain/run/gc_schedule.py) and would inherit that for its life, with nothing collecting."""
    ignore_stop_signals(worker_id)
    gc.enable()


@dataclass
class TrainStreams:
    """The training side of a DataBundle: what BatchStream needs to read the streams of every
    source (one source: a mixture of one)."""

    group: GroupSpec
    num_workers: int = 1
    prefetch_factor: int = 4
    named: bool = False  # data.mixture: streams are saved under their source's name

    @property
    def spec(self) -> StreamSpec:
        return self.group.specs[0]

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def names(self) -> tuple[str, ...]:
        return self.group.mix.names

    def key(self, m: int, s: int) -> str:
        """A stream's name in the checkpoint: its index, or source/index in a mixture."""
        return f"{self.names[m]}/{s}" if self.named else str(s)


class SyntheticBlocks:
    """Uniform random tokens, generated on the device: for benchmarks that exclude data cost."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, device: torch.device):
        self.vocab_size, self.seq_len, self.seed, self.device = vocab_size, seq_len, seed, device
        self._gen = torch.Generator(device=device)

    def get(self, first: int, n: int) -> torch.Tensor:
        # One draw per micro-batch seeded by its first block id: deterministic, one launch.
        self._gen.manual_seed(self.seed * 1_000_003 + first)
        return torch.randint(
            0, self.vocab_size, (n, self.seq_len + 1), generator=self._gen, device=self.device
        )


def read_streams(n_streams: int, rank: int, world: int) -> list[int]:
    """The streams rank `rank` of `world` reads: those holding a block k with k % world == rank."""
    g = gcd(n_streams, world)
    return [s for s in range(n_streams) if (s - rank) % g == 0]


def first_at(residue: int, modulus: int, at: int) -> int:
    """The first k >= at with k % modulus == residue."""
    return at + (residue - at) % modulus


class _RankStreams(torch.utils.data.IterableDataset):
    """What the DataLoader workers of one rank run: worker w of W reads stream indices
    owned[w::W] of every source and yields, per item, this rank's blocks of them in one period
    of the global order (each of the rank's stream indices once), with their positions."""

    def __init__(self, b: TrainStreams, owned, states, consumed: int, rank: int, world: int):
        self.group, self.owned, self.states = b.group, owned, states
        self.consumed, self.rank, self.world = consumed, rank, world

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        S, R = self.group.n_streams, self.world
        mine = self.owned[w::n]
        period = S // gcd(S, R)  # the rank's blocks in which each of its streams comes once
        item = None
        try:
            groups = {
                s: group_blocks(
                    self.group,
                    s,
                    {m: self.states[m, s] for m in range(len(self.group.specs))},
                    k0=first_at(s, S, self.consumed),
                    rank=self.rank,
                    world=R,
                )
                for s in mine
            }
            k = first_at(self.rank, R, self.consumed)
            while True:
                item = ([], [], [], dict.fromkeys(SKIP_KINDS, 0), [])
                for kk in range(k, k + period * R, R):
                    if kk % S in groups:
                        _add(item, next(groups[kk % S]))
                yield item[0], torch.tensor(item[1], dtype=torch.int32), *item[2:]
                k += period * R
        except DataError as e:
            if isinstance(e, SourceEnded):
                yield from _partial(item)
            yield "error", str(e), None, None, None
        except Exception as e:  # a file that breaks mid-read: one line in the main process
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            msg = f"data could not be read ({type(e).__name__}: {first})"
            yield "error", msg, None, None, None


def _add(item, got) -> None:
    """One kept block (group_blocks' tuple) into a worker's item."""
    _, m, blk, pos, skips, notes = got
    item[0].append(m)
    item[1].append(blk)
    item[2].append(pos)
    for kind, v in skips.items():
        item[3][kind] += v
    item[4].extend(notes)


def _partial(item):
    """The blocks a worker read before its stream stopped: the loop trains on them first."""
    if item is not None and item[1]:
        yield item[0], torch.tensor(item[1], dtype=torch.int32), *item[2:]


class _StepReader:
    """Reads this rank's blocks in the global order, one step's micro-batches at a time.

    Runs in the Prefetcher's thread, ahead of the loop: it keeps its own copy of the streams'
    positions and hands each step's over with its blocks, so the BatchStream reports the
    position of the last step the loop took, not of the last step read.
    """

    def __init__(
        self,
        b: TrainStreams,
        owned,
        states,
        *,
        consumed: int,
        rank: int,
        world: int,
        micro: int,
        accum: int,
        pin: bool,
    ):
        self.spec, self.world, self.micro, self.accum, self.pin = b.spec, world, micro, accum, pin
        self.states = dict(states)
        self.queues: dict[int, deque] = {s: deque() for s in owned}
        self.blocks_of = [0] * len(b.names)  # blocks of each source read for the loop
        self.notes: list[tuple[str, str]] = []
        workers = min(b.num_workers, len(owned))
        ds = _RankStreams(b, owned, dict(states), consumed, rank, world)
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=None,  # items are already one block per stream of a worker
            num_workers=workers,
            pin_memory=False,  # the stacked micro-batch is pinned instead (one copy, not two)
            prefetch_factor=b.prefetch_factor if workers else None,
            persistent_workers=False,
            worker_init_fn=_worker_init if workers else None,
        )
        # The workers fork with the collector's objects frozen, so a worker (whose collector
        # _worker_init turns on) never collects what it inherited: the parent's garbage
        # collected there runs its destructors in the worker. A gloo process group left by an
        # earlier run in the same process deadlocked so, in its destructor, on a condition
        # variable copied mid-use (CI, 2026-11-30: the run waited on its data for good).
        # Objects other threads make during the fork are not frozen: new ones, not the old
        # garbage this is for. A process that froze its own objects (gc.freeze before fork,
        # for copy-on-write) keeps them, and these, frozen.
        thaw = workers and gc.get_freeze_count() == 0
        if workers:
            gc.freeze()
        try:
            self.it = iter(loader)
        finally:
            if thaw:
                gc.unfreeze()
        self.k = first_at(rank, world, consumed)  # the global index of this rank's next block
        if workers:
            _live_readers.add(self)

    def close(self) -> None:
        """End the DataLoader workers now, not whenever the iterator happens to be collected.

        They ignore SIGTERM (ignore_stop_signals), so multiprocessing's exit hook, which
        terminates and then joins them, would wait forever on one left alive: an error's
        traceback holds this reader, so a run that stopped on bad data hung at exit.
        """
        it, self.it = self.it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # what the iterator's __del__ does; joins, else kills

    def _next_block(self, skipped: dict) -> torch.Tensor:
        s = self.k % self.spec.n_streams
        q = self.queues[s]
        while not q:
            try:
                sources, blocks, states, skips, notes = next(self.it)
            except BaseException:
                self.close()
                raise
            if sources == "error":
                self.close()
                raise DataError(blocks)
            self.notes.extend(notes)
            for j, m in enumerate(sources):
                s2 = states[j]["k"] % self.spec.n_streams
                self.queues[s2].append((blocks[j], m, states[j], skips if j == 0 else None))
        blk, m, st, sk = q.popleft()
        self.states[m, s] = st
        self.blocks_of[m] += 1
        for kind, n in (sk or {}).items():
            skipped[kind] += n
        self.k += self.world
        return blk

    def read_step(self) -> StepRead:
        """The step's accum micro-batches of blocks, the positions after them, the records
        skipped, the blocks of each source, and what to say about the sources."""
        skipped = dict.fromkeys(SKIP_KINDS, 0)
        self.blocks_of = [0] * len(self.blocks_of)
        out = []
        for _ in range(self.accum):
            blk = torch.stack([self._next_block(skipped) for _ in range(self.micro)])
            out.append(blk.pin_memory() if self.pin else blk)
        notes, self.notes = self.notes, []
        return StepRead(out, dict(self.states), skipped, list(self.blocks_of), notes)


class StepRead(NamedTuple):
    blocks: list[torch.Tensor]
    states: dict
    skipped: dict
    blocks_of: list[int]  # this step's blocks of each source, on this rank
    notes: list[tuple[str, str]]


# Readers with worker processes, closed at exit before multiprocessing joins their workers
# (this module registers its hook after multiprocessing's, so it runs first).
_live_readers: weakref.WeakSet[_StepReader] = weakref.WeakSet()


@atexit.register
def _close_live_readers() -> None:
    for reader in list(_live_readers):
        reader.close()


class Prefetcher:
    """Calls `produce()` in a background thread, up to `depth` results ahead of `get()`.

    Reading a step's blocks from the DataLoader in the loop's own thread (unpickling, passing
    handles, stacking) stalled the GPU whatever the number of workers (docs/benchmarks.md,
    "Data wait on the GPU"); here that work overlaps the GPU step (the reads release the
    GIL). An exception in `produce` is
    raised again by the `get()` that would have returned its result. The thread holds the
    producer only, not the owner, so a dropped owner is collected and closes it.
    """

    def __init__(self, produce, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(produce, self._q, self._stop), daemon=True, name="dtrain-data"
        )
        self._thread.start()

    @staticmethod
    def _run(produce, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (True, produce())
            except BaseException as e:  # handed to the loop's thread, raised there
                item = (False, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    def get(self):
        ok, item = self._q.get()
        if not ok:
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a put() at once
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)


def sharing_note(n_streams: int, world: int) -> str | None:
    """Where ranks share streams: how much more each tokenizes than it trains on, and the fix."""
    share = world // gcd(n_streams, world)
    if share == 1:
        return None
    return (
        f"data: {world} ranks read data.num_streams={n_streams} streams, so each rank tokenizes "
        f"{share}x the blocks it trains on; data.num_streams={_multiple(n_streams, world)} "
        "reads each record once (for a new run: a resume keeps the checkpoint's)"
    )


def _multiple(n_streams: int, world: int) -> int:
    """The smallest multiple of the world size at least n_streams."""
    return -(-n_streams // world) * world


def merge_positions(per_rank: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Every rank's (stream positions, skip counts) -> the run's: of the ranks that read a
    stream, the position after the latest block any of them took ("k", its global index)."""
    streams: dict[str, dict] = {}
    skipped = dict.fromkeys(SKIP_KINDS, 0)
    for positions, skips in per_rank:
        for key, st in positions.items():
            if st.get("k", -1) >= streams.get(key, {}).get("k", -1):
                streams[key] = st
        for kind, n in skips.items():
            skipped[kind] += n
    return streams, skipped


class BatchStream:
    """This rank's micro-batches, step after step: `next_step()`, `state_dict()`, resume.

    The blocks of the next steps are read ahead in a background thread (Prefetcher); the loop's
    thread only copies a pinned micro-batch to the device.
    """

    PREFETCH_STEPS = 2

    def __init__(
        self,
        blocks,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        copies: int = 1,
    ):
        """rank, world_size: data-parallel; `copies` consecutive processes share each rank's
        batches (tensor and context parallel groups: dtrain.parallel.mesh.data_coords)."""
        self.copies = copies
        self.blocks, self.micro, self.accum = blocks, micro_batch_size, grad_accum_steps
        self.rank, self.world, self.seed, self.device = rank, world_size, seed, device
        self.consumed = 0  # blocks (sequences) consumed by all ranks before the next step
        self.skipped = dict.fromkeys(SKIP_KINDS, 0)  # records skipped on this rank
        self.synthetic = isinstance(blocks, SyntheticBlocks)
        self._prefetch: Prefetcher | None = None
        self.blocks_of: list[int] = []  # blocks of each source this rank trained on
        self.blocks_before: dict[str, int] = {}  # of each source, all ranks, before the resume
        self.said: set[tuple[str, str]] = set()
        if not self.synthetic:
            self.owned = read_streams(blocks.spec.n_streams, rank, world_size)
            if rank == 0 and (note := sharing_note(blocks.spec.n_streams, world_size)):
                log.info(note)
            self.states = {
                (m, s): start_state() for m in range(len(blocks.names)) for s in self.owned
            }
            self.blocks_of = [0] * len(blocks.names)

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    # --- reading ----------------------------------------------------------------------------

    def _start(self) -> None:
        # The rank's next block: the first k >= consumed with k % world == rank.
        reader = _StepReader(
            self.blocks,
            self.owned,
            self.states,
            consumed=self.consumed,
            rank=self.rank,
            world=self.world,
            micro=self.micro,
            accum=self.accum,
            pin=self.device.type == "cuda",
        )
        self._prefetch = Prefetcher(reader.read_step, depth=self.PREFETCH_STEPS)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The accum micro-batches (x, y) of this rank for the next step; advances the stream."""
        out = []
        if self.synthetic:
            for m in range(self.accum):
                first = self.consumed + m * self.micro * self.world + self.rank * self.micro
                blk = self.blocks.get(first, self.micro)
                out.append((blk[:, :-1], blk[:, 1:]))
        else:
            if self._prefetch is None:
                self._start()
            got: StepRead = self._prefetch.get()
            self.states.update(got.states)
            for kind, n in got.skipped.items():
                if n and not self.skipped[kind]:
                    log.warning("skipping bad records (%s); counts are in the checkpoint", kind)
                self.skipped[kind] += n
            for m, n in enumerate(got.blocks_of):
                self.blocks_of[m] += n
            for note in map(tuple, got.notes):  # the DataLoader hands tuples over as lists
                if note not in self.said:
                    self.said.add(note)
                    say_note(*note, dict(zip(self.blocks.names, self.blocks.group.mix.weights)))
            out = [self._to_device(blk) for blk in got.blocks]
        self.consumed += self.global_batch
        return out

    def _to_device(self, blk: torch.Tensor):
        blk = blk.to(self.device, non_blocking=True).long()
        return blk[:, :-1], blk[:, 1:]

    def close(self) -> None:
        """Stop reading ahead (the DataLoader workers exit with the reader)."""
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None

    def __del__(self):
        self.close()

    # --- position -----------------------------------------------------------------------------

    def source_blocks(self) -> dict[str, int]:
        """Blocks of each source trained on so far, all ranks (a collective: all ranks call it
        together)."""
        if self.synthetic:
            return {}
        counts = list(self.blocks_of)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and self.world * self.copies > 1:
            # objects, not a tensor: whatever the backend's device (NCCL's is the GPU)
            gathered = [None] * (self.world * self.copies)
            dist.all_gather_object(gathered, counts)
            counts = [sum(c) for c in zip(*gathered[:: self.copies])]
        return {
            name: self.blocks_before.get(name, 0) + n for name, n in zip(self.blocks.names, counts)
        }

    def state_dict(self) -> dict:
        """The position, gathered from every rank (a collective: all ranks call it together).
        Of ranks that read a stream, the one that took its latest block holds its position."""
        state = {"consumed": self.consumed, "seq_len": self.blocks.seq_len}
        if self.synthetic:
            return state
        mine = {self.blocks.key(m, s): st for (m, s), st in self.states.items()}
        skipped = dict(self.skipped)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and self.world * self.copies > 1:
            gathered = [None] * (self.world * self.copies)
            dist.all_gather_object(gathered, (mine, skipped))
            mine, skipped = merge_positions(gathered[:: self.copies])  # one of each rank's copies
        state.update(
            n_streams=self.blocks.spec.n_streams,
            streams=mine,
            skipped=skipped,
            world_size=self.world,
            source_blocks=self.source_blocks(),
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len") != self.blocks.seq_len:
            raise DataError(
                f"the checkpoint's data position is in blocks of seq_len={state.get('seq_len')}, "
                f"this run uses {self.blocks.seq_len}; resume with the same trainer.seq_len"
            )
        if not self.synthetic:
            self._load_streams(state)
            self.close()  # what was read ahead belongs to the old position
        self.consumed = int(state["consumed"])

    def _load_streams(self, state: dict) -> None:
        S = self.blocks.spec.n_streams
        if "streams" not in state:
            raise DataError(
                "the checkpoint holds no stream positions (saved with another data "
                "source); resume with the data config it was trained with"
            )
        if state["n_streams"] != S:
            raise DataError(
                f"the checkpoint's data is cut into {state['n_streams']} streams, this run "
                f"into data.num_streams={S}; resume with data.num_streams={state['n_streams']}"
            )
        saved, names = state["streams"], self.blocks.names
        new = sorted({names[m] for m, s in self.states if self.blocks.key(m, s) not in saved})
        if new and not self.blocks.named:
            raise DataError(
                "the checkpoint holds no position for this data (saved with a mixture); "
                "resume with the data config it was trained with"
            )
        if new and self.rank == 0:
            log.info("data sources new in this run start at their beginning: %s", ", ".join(new))
        for m, s in self.states:
            self.states[m, s] = dict(saved.get(self.blocks.key(m, s), start_state()))
        self.blocks_before = dict(state.get("source_blocks", {}))
        self.blocks_of = [0] * len(names)


class EvalBlocks:
    """The held-out blocks: the eval split, or the documents `is_heldout` keeps from training.

    Read in source order (no shuffle) in the process that evaluates, once, then cached: every
    eval scores the same blocks.
    """

    def __init__(self, spec: StreamSpec, holdout: float):
        self.spec, self.holdout = spec, holdout  # holdout 0: all records of spec.source
        self.seq_len = spec.seq_len
        self._cache: torch.Tensor | None = None

    def get(self, n: int) -> torch.Tensor:
        if self._cache is None or self._cache.shape[0] < n:
            self._cache = self._read(n)
        blocks = self._cache
        if blocks.shape[0] < n:  # a small holdout: score it several times over
            blocks = blocks.repeat((n + blocks.shape[0] - 1) // blocks.shape[0], 1)
        return blocks[:n]

    def _read(self, n: int) -> torch.Tensor:
        from dtrain.data.sources import open_records

        T, tok, field = self.seq_len, self.spec.tokenizer, self.spec.source.text_field
        out, buf = [], []
        for rec in open_records(self.spec.source):
            text = rec.get(field)
            if classify(text) is not None or (self.holdout and not is_heldout(text, self.holdout)):
                continue
            buf.extend(tok.encode(text))
            buf.append(tok.eot_id)
            while len(buf) >= T + 1:
                out.append(buf[: T + 1])
                buf = buf[T:]
            if len(out) >= n:
                break
        if not out:
            raise DataError(
                f"the eval set has fewer than {T + 1} tokens: raise data.eval_fraction "
                f"(now {self.holdout}) or use more data"
            )
        return torch.tensor(out, dtype=torch.int32)


def eval_batches(
    blocks, *, micro_batch_size: int, steps: int, rank: int, world_size: int, device: torch.device
):
    """The same held-out batches at every eval, split across ranks."""
    per_step = micro_batch_size * world_size
    for i in range(steps):
        first = i * per_step + rank * micro_batch_size
        if isinstance(blocks, SyntheticBlocks):
            blk = blocks.get(first, micro_batch_size)
        else:
            blk = blocks.get(steps * per_step)[first : first + micro_batch_size]
            blk = blk.to(device, non_blocking=True).long()
        yield blk[:, :-1], blk[:, 1:]
