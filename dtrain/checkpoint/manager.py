"""CheckpointManager: when to save, atomic (and async) save, pruning, load, resume=auto.

Layout of one checkpoint (torch.distributed.checkpoint, one shard file per rank):

    checkpoints/step_0000100/
        __0_0.distcp ...      model + optimizer shards (DCP)
        .metadata             DCP's index of the shards
        extra_rank{r}.pt      per-rank RNG state and the rank's own state, e.g. fp8 delayed
                              scaling's amax histories (weights_only-loadable)
        manifest.json         step, run identity, data position, sha256 of every file
        COMPLETE              the marker, written last: the sha256 of manifest.json
                              (`sha256sum -c COMPLETE` in the folder checks it)

A checkpoint is written under `step_NNNNNNN.partial/` and renamed to `step_NNNNNNN/` only after
every rank has finished and the manifest and marker are on disk: a crash at any point leaves
either the previous checkpoint set or a `.partial` folder that discovery ignores. Old ones are
pruned (renamed to `.deleting`, then removed) only after a newer one is complete.

checkpoint.async_save: save_async() takes the same snapshot at the save's step (DCP copies the
tensors to host memory, on CUDA into pinned buffers kept from one save to the next; the RNG
state and the manifest are taken then) and writes, fsyncs, hashes and commits it in a background
thread, on a gloo process group of its own, while the loop trains on. COMPLETE is written, as in
save(), only after every rank's files are fsynced and hashed. One save at a time: the next one,
the end of the run or a stop waits for it (finish()); a failure is the same CheckpointSaveError,
raised on the main thread.

Loading trusts nothing on disk: the manifest is checked against the marker's sha256 and its
step against the folder's name, every file's sha256 against the manifest (a truncated or
altered shard is named), the manifest's fields against their types and ranges, DCP's pickled
`.metadata` is read by an unpickler that admits an exact list of DCP's own metadata classes,
the pickled non-tensor items inside the shards (the optimizer's param_groups) and
`extra_rank*.pt` are read as plain values only (dtrain.checkpoint.safe_load), and each rank's
RNG state is checked before it is applied. Loaders open only regular files the manifest
lists: a link, FIFO, socket, device or directory in their place is refused without being opened
or followed. No code in a checkpoint runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from dtrain import dist as ddist
from dtrain.checkpoint.files import (
    create_new,
    file_kind,
    fsync_dir,
    remove_own_dir,
    rename_new,
    sha256_file,
    synced_hash,
    write_atomic,
)
from dtrain.checkpoint.host_memory import (
    HOST_SHARE,
    available_host_bytes,
    host_bytes,
    pinned_staging,
)
from dtrain.checkpoint.integrity import check_checkpoint
from dtrain.checkpoint.layout import (
    MANIFEST,
    MARKER,
    latest_complete,
    list_complete,
    list_step_dirs,
    marker_text,
    newer_checkpoints,
    step_dir_name,
)
from dtrain.checkpoint.manifest import read_manifest
from dtrain.checkpoint.rank_state import read_rank_state, rng_state, set_rng_state
from dtrain.checkpoint.writer import describe_save_error, storage_writer
from dtrain.config import CheckpointConfig
from dtrain.errors import CheckpointError, ConfigError
from dtrain.host_staging import host_buffers
from dtrain.reliability import faults

# DCP warns on every save/load without a process group; a single process is intended there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")

log = logging.getLogger("dtrain")


class Loaded(NamedTuple):
    """What CheckpointManager.load gives back besides the state it loaded."""

    manifest: dict
    rank_state: dict | None  # save()'s rank_state: this rank's, or that of `from_rank`
    from_rank: int | None  # None: this rank's own; else the number of ranks changed, this one
    # modulo the saved number


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, unwritable folder, ...); nothing was marked complete."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another run (model, data, ...): resume=auto must not skip past it."""


@dataclass
class Saved:
    """A checkpoint complete on disk, and what it cost the training loop."""

    step: int
    path: Path
    background: bool  # written by an async save
    stall_s: float  # the loop was blocked by it: snapshot, staging, waiting for it, committing
    save_s: float  # from the start of the save to its COMPLETE marker
    # Two parts of stall_s: the caller's snapshot (taking the state, checking it finite), and
    # DCP's call on the loop's thread: dcp.save's plan and write (sync), or dcp.async_save's
    # staging to host memory (async: DCP plans in its background thread). None: not measured.
    snapshot_s: float | None = None
    dcp_s: float | None = None
    # An async save: the part of stall_s at the save itself (snapshot, staging, starting the
    # write); the rest is waiting for the write later (the next save, the end of the run).
    at_save_s: float | None = None
    # The first async save on a GPU: the part of at_save_s spent making the pinned host
    # buffers every later save reuses (dtrain.host_staging).
    buffers_s: float | None = None


@dataclass
class _InFlight:
    step: int
    started: float  # time.perf_counter() when the save began (before the state was taken)
    future: Future  # the background write and commit -> (path, finish time), or raises
    stall_s: float  # loop time blocked by this save so far
    snapshot_s: float | None  # Saved.snapshot_s
    dcp_s: float | None  # Saved.dcp_s
    at_save_s: float = 0.0  # Saved.at_save_s
    buffers_s: float | None = None  # Saved.buffers_s


class CheckpointManager:
    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 600.0,
    ):
        self.root = Path(run_dir) / "checkpoints"
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._verified: set[Path] = set()  # checked already (find_resumable, trust)
        self.rejected: list[Path] = []  # skipped by find_resumable, newest first
        self.timeout_s = timeout_s  # of the background saves' collectives
        self._in_flight: _InFlight | None = None  # at most one async save at a time
        self._group = None  # the background saves' process group (made at the first one)
        self._executor: ThreadPoolExecutor | None = None
        self._writer = None  # the async saves' one writer (and its host buffers)
        self._async: bool | None = None  # periodic saves in the background (use_async)
        self._host = None  # (state dict, buffer): the pinned buffers before the first async save
        self._buffers_s: float | None = None  # the time making them took
        if cfg.async_save:
            import torch.distributed.checkpoint as dcp

            if not hasattr(dcp, "async_save"):
                raise ConfigError(
                    f"checkpoint.async_save=true needs torch.distributed.checkpoint.async_save "
                    f"(torch >= 2.6); this is torch {torch.__version__}: set "
                    "checkpoint.async_save=false or upgrade torch"
                )

    def use_async(self, state: dict) -> bool:
        """Whether periodic saves are written in the background: checkpoint.async_save, or
        with null (the default) where there is a GPU and torch has DCP's async_save. Decided
        at the first periodic save, on every rank alike (collective). On a GPU that is where
        the pinned host buffers are made (_prepare_host_buffers); where they cannot be, saves
        stay synchronous, said in one warning, with `true` as with null."""
        if self._async is None:
            import torch.distributed.checkpoint as dcp

            wanted = self.cfg.async_save
            if wanted is None:
                wanted = pinned_staging() and hasattr(dcp, "async_save")
            if wanted and pinned_staging():
                wanted = self._prepare_host_buffers(state)
            self._async = bool(wanted)
        return self._async

    def _prepare_host_buffers(self, state: dict) -> bool:
        """Make the pinned buffers async saves stage into, where this node's ranks' state fits
        in HOST_SHARE of its available memory; False on every rank if on any it does not, or
        pinning failed there. Collective."""
        need = host_bytes(state) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        have = available_host_bytes()
        why = None
        if have is not None and need > HOST_SHARE * have:
            why = (
                f"async saves would pin {need / 1024**3:.2f} GiB of host memory on this node "
                f"(its ranks' state) and {have / 1024**3:.2f} GiB are available (at most "
                f"{int(HOST_SHARE * 100)}% used for them)"
            )
        else:
            try:
                self._pin_host_buffers(state)
            except RuntimeError as e:  # cudaHostRegister refused
                why = f"the host buffers of async saves could not be pinned ({e})"
        whys = ddist.all_gather_object(why) if self.world_size > 1 else [why]
        first = next(((r, w) for r, w in enumerate(whys) if w), None)
        if first is not None:
            self._host = None
            log.warning(
                "checkpoints are written synchronously: %s%s; set checkpoint.async_save=false "
                "to silence this",
                f"rank {first[0]}: " if self.world_size > 1 else "",
                first[1],
            )
            return False
        return True

    def _pin_host_buffers(self, state: dict) -> None:
        t0 = time.perf_counter()
        self._host = host_buffers(state, pin=True)
        self._buffers_s = time.perf_counter() - t0

    def due(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    # --- save --------------------------------------------------------------------------
    # A save is in two halves. This rank's part: DCP's shards, extra_rank{r}.pt, each file
    # fsynced and hashed. Then the commit, collective: the hashes (or errors) gathered, rank 0
    # writes the manifest and COMPLETE and renames the folder, and every rank learns the
    # outcome. save() runs both on the calling thread; save_async() copies the state to host
    # memory and runs both in the background, on a process group of their own.

    @property
    def in_flight(self) -> int | None:
        """The step of the async save being written, if any."""
        return self._in_flight.step if self._in_flight else None

    def save(
        self,
        step: int,
        state: dict,
        manifest: dict,
        *,
        started: float | None = None,
        snapshot_s: float | None = None,
        rank_state: dict | None = None,
    ) -> Saved:
        """Save `state` (DCP state dict) at `step`; returns a Saved. Collective: every rank
        calls it. `started`: when the caller began preparing the save (time.perf_counter()),
        counted in the stall; `snapshot_s`: how much of that went to taking the state;
        `rank_state`: this rank's own (tensors and plain values), kept with its RNG state.

        An OS error on any rank (disk full, read-only or vanished folder) becomes a
        CheckpointSaveError on every rank, after the .partial folder is removed; the
        previous complete checkpoint is untouched. Other exceptions are bugs and propagate.
        """
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter() if started is None else started
        self._check_idle()
        partial, err = self._begin(step)

        dcp_s = None

        def write() -> None:
            nonlocal dcp_s
            faults.point("ckpt.save.after_mkdir", step=step)
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=storage_writer(partial, step))
            dcp_s = time.perf_counter() - t0

        result = err or self._write_rank_files(step, write, rng_state(), rank_state)
        path = self._commit(step, result, manifest)
        took = time.perf_counter() - started
        return Saved(step, path, False, took, took, snapshot_s=snapshot_s, dcp_s=dcp_s)

    def save_async(
        self,
        step: int,
        state: dict,
        manifest: dict,
        *,
        started: float | None = None,
        snapshot_s: float | None = None,
        rank_state: dict | None = None,
    ) -> None:
        """Start saving `state` at `step` in the background; the loop goes on once the state
        is copied to host memory (DCP's staging). What is saved is this step's: the tensors
        are copied, the RNG state and the manifest (the data position) taken now, and
        `rank_state` must be a host copy (as save()'s). Collective.

        The checkpoint is complete (COMPLETE written, folder renamed) only after every rank's
        files are written and fsynced; poll() or finish() report it, or raise the same
        CheckpointSaveError that save() would.
        """
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter() if started is None else started
        self._check_idle()
        partial, err = self._begin(step)
        if err is not None:
            self._commit(step, err, manifest)  # raises, as save() does
        # making the host buffers: the first async save only
        buffers_s = self._start_background(partial, step, state) if self._executor is None else None
        self._writer.step = step
        manifest = json.loads(json.dumps(manifest))  # a copy: the position may move on
        rng = rng_state()
        dcp_s = None
        try:
            faults.point("ckpt.save.after_mkdir", step=step)
            t0 = time.perf_counter()
            # One writer for every async save, pointed at this save's folder: its host
            # buffers are free again because the previous save has completed (_check_idle).
            staged = dcp.async_save(
                state,
                checkpoint_id=str(partial),
                storage_writer=self._writer,
                process_group=self._group,
            )
            dcp_s = time.perf_counter() - t0
            # An AsyncSaveResponse where torch stages in the background too (not asked here).
            written = getattr(staged, "upload_completion", staged)
        except OSError as e:  # reported as a failed write, by the commit on every rank
            written = Future()
            written.set_exception(e.with_traceback(None))  # no cycle through this frame

        def finish() -> tuple[Path, float]:
            result = self._write_rank_files(step, written.result, rng, rank_state)
            return self._commit(step, result, manifest, group=self._group), time.perf_counter()

        future = self._executor.submit(finish)
        stall = time.perf_counter() - started
        self._in_flight = _InFlight(
            step, started, future, stall, snapshot_s, dcp_s, stall, buffers_s
        )

    def _start_background(self, partial: Path, step: int, state: dict) -> float | None:
        """The first async save: the background thread, its process group and the one writer
        of every async save, with its pinned host buffers on a GPU. The time making them took."""
        self._group = ddist.new_background_group(self.timeout_s)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dtrain-checkpoint")
        pinned = pinned_staging()
        self._writer = storage_writer(partial, step, keep_host_buffers=pinned)
        if not pinned:
            return None
        # the writer's cache: one page-locked allocation (use_async made it)
        if self._host is None:  # called without use_async
            self._pin_host_buffers(state)
        (cache, self._writer.host_buffer), self._host = self._host, None
        self._writer.state_dict_cache = cache
        buffers_s, self._buffers_s = self._buffers_s, None
        log.info(
            "async checkpoints: %.2f GiB of pinned host memory per rank (made in "
            "%.1f s) hold the state being written, for the rest of the run",
            self._writer.host_buffer.numel() / 1024**3,
            buffers_s,
        )
        return buffers_s

    def poll(self, sync_point: bool) -> Saved | None:
        """The async save, if it is complete on every rank (else None, without waiting).
        Ranks must agree on when they take it: under torchrun only at a `sync_point` (every
        rank calls poll at the same steps, and those with True gather a flag), alone at once."""
        job = self._in_flight
        if job is None or (self.world_size > 1 and not sync_point):
            return None
        t0 = time.perf_counter()
        done = job.future.done()
        if self.world_size > 1:
            done = all(ddist.all_gather_object(done))
        job.stall_s += time.perf_counter() - t0
        return self.finish() if done else None

    def finish(self) -> Saved | None:
        """Wait for the async save (if any) to be complete: its Saved, or the
        CheckpointSaveError of its failure. Collective (every rank calls it)."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return None
        t0 = time.perf_counter()
        future, job.future = job.future, None
        try:
            path, done = future.result()
        finally:  # a failure's traceback holds this frame: no cycle back to its future (which
            del future  # would keep the loop's frame, its data loader included, past the exit)
        stall = job.stall_s + time.perf_counter() - t0
        return Saved(
            job.step,
            path,
            background=True,
            stall_s=stall,
            save_s=done - job.started,
            snapshot_s=job.snapshot_s,
            dcp_s=job.dcp_s,
            at_save_s=job.at_save_s,
            buffers_s=job.buffers_s,
        )

    def close(self) -> None:
        """End the background thread. After an error, an async save still in flight is waited
        for, without raising: it completes if every rank's thread gets through it, otherwise
        it stays a .partial folder, never loaded (with a dead peer: within timeout_s)."""
        job, self._in_flight = self._in_flight, None
        failed = job.future.exception() if job is not None else None
        if failed is not None:  # the run's own error is the one reported
            log.warning("checkpoint %s not completed: %s", step_dir_name(job.step), failed)
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self._writer = None  # its pinned host buffers go with it

    def _check_idle(self) -> None:
        # One save at a time: a second would race the first's commit (and its pruning).
        if self._in_flight is not None:
            raise RuntimeError(f"a save of step {self._in_flight.step} is in flight: finish() it")

    def _paths(self, step: int) -> tuple[Path, Path]:
        final = self.root / step_dir_name(step)
        return final, final.with_name(final.name + ".partial")

    def _begin(self, step: int) -> tuple[Path, str | None]:
        """Rank 0 makes an empty .partial folder; every rank gets it, or the error."""
        _, partial = self._paths(step)
        err = None
        if self.rank == 0:
            try:
                faults.point("ckpt.save.begin", step=step)
                self.root.mkdir(parents=True, exist_ok=True)
                remove_own_dir(partial)  # left by a crash: never part of a complete one
                partial.mkdir()  # fails on anything there: the folder is this save's alone
            except OSError as e:
                err = f"{e}"
        err = ddist.broadcast_object(err)  # also the barrier before anyone writes
        return partial, err

    def _write_rank_files(self, step: int, write, rng: dict, rank_state: dict | None) -> dict | str:
        """This rank's part: `write()` (DCP's shards), then extra_rank{r}.pt; each file
        fsynced and hashed. {name: (sha256, size)}, or one line naming an OS-level failure
        (anything else is a bug, and raises)."""
        from torch.distributed.checkpoint.api import CheckpointException

        _, partial = self._paths(step)
        try:
            write()
            faults.point("ckpt.save.after_dcp", step=step)
            extra_path = partial / f"extra_rank{self.rank}.pt"
            with create_new(extra_path) as f:
                torch.save({"rng": rng, "rank": rank_state or {}}, f)
            faults.point("ckpt.save.after_extra", step=step)
            mine = [extra_path] + sorted(partial.glob(f"__{self.rank}_*.distcp"))
            return {p.name: synced_hash(p) for p in mine}
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            why = describe_save_error(e, partial)
            if why is None:
                raise
            return f"{why} (rank {self.rank})" if "(rank " not in why else why

    def _commit(self, step: int, result: dict | str, manifest: dict, group=None) -> Path:
        """The collective half of a save, over `group`: every rank's hashes (or error) to
        rank 0, which writes the manifest, COMPLETE and renames; CheckpointSaveError on every
        rank if any failed, with the .partial folder removed."""
        final, partial = self._paths(step)
        gathered = ddist.all_gather_object(result, group=group)
        err = next((g for g in gathered if isinstance(g, str)), None)
        if self.rank == 0 and err is None:
            try:
                faults.point("ckpt.save.after_hash", step=step)
                files = {}
                for g in gathered:
                    files.update(g)
                if (partial / ".metadata").exists():
                    files[".metadata"] = synced_hash(partial / ".metadata")
                fsync_dir(partial)  # the files' names too, before the manifest lists them
                manifest = {
                    **manifest,
                    "step": step,
                    "world_size": self.world_size,
                    "files": {k: v[0] for k, v in files.items()},
                    "sizes": {k: v[1] for k, v in files.items()},
                }
                write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
                faults.point("ckpt.save.after_manifest", step=step)
                # The marker signs the manifest: an edited step or data position is refused.
                write_atomic(partial / MARKER, marker_text(sha256_file(partial / MANIFEST)))
                faults.point("ckpt.save.after_marker", step=step)
                remove_own_dir(final)  # an older save of the same step (e.g. rerun)
                os.replace(partial, final)
                fsync_dir(self.root)
            except OSError as e:
                err = str(e)
            if err is None:
                faults.point("ckpt.save.after_rename", step=step)
                self._prune()
        err = ddist.broadcast_object(err, group=group)
        if err is not None:
            if self.rank == 0:  # nothing half-written stays behind, and nothing is complete
                shutil.rmtree(partial, ignore_errors=True)
            latest = latest_complete(self.root)
            raise CheckpointSaveError(
                f"checkpoint {final.name} could not be saved: {err}; nothing was marked "
                f"complete; the newest complete checkpoint is "
                f"{latest.name if latest else 'none'}"
            )
        return final

    def _prune(self) -> None:
        """Keep the newest keep_last complete checkpoints; called only after a new one is
        complete, so the last complete checkpoint is never deleted before its successor.

        Each victim is first renamed to `.deleting` (atomic), so a crash in the middle of
        removing it never leaves a half-deleted folder that still looks complete."""
        # A .partial folder here is left by a save that died (saves never overlap, async ones
        # included: this runs in a save's commit, and the next save waits for it): drop it.
        for stale in self.root.glob("step_*.partial"):
            remove_own_dir(stale, quiet=True)
        for leftover in self.root.glob("step_*.deleting"):
            remove_own_dir(leftover, quiet=True)
        if self.cfg.keep_last <= 0:
            return
        complete = list_complete(self.root)
        for _, path in complete[: -self.cfg.keep_last]:
            doomed = path.with_name(path.name + ".deleting")
            try:
                rename_new(path, doomed)
                faults.point("ckpt.prune")
                shutil.rmtree(doomed)
            except OSError as e:  # a full disk must not turn a good save into a failure
                log.warning("could not remove old checkpoint %s: %s", path, e)

    # --- load --------------------------------------------------------------------------
    read_manifest = staticmethod(read_manifest)

    def _check(self, path: Path, manifest: dict) -> None:
        rank, world = self.rank, self.world_size
        check_checkpoint(path, manifest, files=self.cfg.verify, rank=rank, world_size=world)

    def load(self, path: Path, state: dict) -> Loaded:
        """Load into `state` (a DCP state dict template) in place and restore this rank's RNG
        state; return the manifest and a rank's own state (save()'s `rank_state`): this
        rank's, or where the checkpoint was saved by another number of ranks, that of this
        rank modulo theirs (its RNG state is then not restored: it would repeat that rank's
        draws). None where the checkpoint has none (a dtrain that kept only RNG states)."""
        from dtrain.checkpoint.safe_load import load_into

        path = Path(path)
        manifest = self.read_manifest(path)
        if path not in self._verified:
            self._check(path, manifest)
        load_into(path, state, manifest["files"])
        saved_world = manifest.get("world_size")
        same = saved_world == self.world_size
        if not same and saved_world is None:
            return Loaded(manifest, None, None)
        source = self.rank if same else self.rank % saved_world
        extra = f"extra_rank{source}.pt"
        if extra not in manifest["files"]:  # only files the manifest vouches for are read
            return Loaded(manifest, None, None)
        rng, rank_state = read_rank_state(path, extra)
        if same:
            set_rng_state(rng)
        return Loaded(manifest, rank_state, None if same else source)

    def trust(self, path: Path) -> None:
        """Count `path` as verified, e.g. by rank 0's find_resumable: load() does not hash it
        again (checkpoint.verify reads every byte, which is minutes for a large model)."""
        self._verified.add(Path(path))

    def find_resumable(self, accept=None) -> tuple[Path, dict] | None:
        """resume=auto: the newest checkpoint folder that passes every check.

        One that fails (no marker, a missing, edited or corrupt manifest, a corrupt file) is
        skipped with a warning naming it and why, and the previous one is tried; the skipped
        ones are listed in self.rejected (see set_aside). `accept(path, manifest)` may raise
        CheckpointError to stop the search (e.g. a checkpoint of another model: falling back
        would silently resume the wrong run). None if there is no checkpoint folder;
        CheckpointError if none is intact.
        """
        found = list_step_dirs(self.root)
        problems = []
        self.rejected = []
        for i, (_, path) in enumerate(reversed(found)):
            try:
                if file_kind(path / MARKER) == "missing":  # read_manifest's advice: resume=PATH
                    raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
                manifest = self.read_manifest(path)
                if accept is not None:
                    accept(path, manifest)
                self._check(path, manifest)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                problems.append(str(e))
                self.rejected.append(path)
                if self.rank == 0:
                    nxt = found[-2 - i][1].name if i + 1 < len(found) else None
                    log.warning(
                        "%s; %s", e, f"falling back to {nxt}" if nxt else "no older checkpoint"
                    )
                continue
            self.trust(path)
            return path, manifest
        if not found:
            return None
        raise CheckpointError(
            f"no intact checkpoint in {self.root}: "
            + " | ".join(problems)
            + "; move the bad ones away, or start a new run dir"
        )

    def set_aside(self, paths: list[Path]) -> None:
        """Rename checkpoints that resume=auto skipped to `<name>.rejected`: kept as evidence,
        out of reach of discovery, pruning and the save of the same step."""
        for path in paths:
            target, n = path.with_name(path.name + ".rejected"), 1
            while os.path.lexists(target):
                n += 1
                target = path.with_name(f"{path.name}.rejected{n}")
            try:
                rename_new(path, target)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint {path} was skipped but could not be set aside ({e}); this run "
                    "would overwrite it: move it out of the checkpoints folder"
                ) from None
            log.warning(
                "kept the skipped checkpoint %s as %s: it is never loaded, overwritten or "
                "pruned; delete it once it is no longer needed",
                path.name,
                target.name,
            )

    def remove_newer(self, step: int) -> None:
        """checkpoint.overwrite_newer=true: delete the checkpoints past the resume point, so
        that this run's checkpoints never mix with the abandoned ones (rank 0)."""
        for path in newer_checkpoints(self.root, step):
            doomed = path.with_name(path.name + ".deleting")  # never half-deleted yet complete
            try:
                rename_new(path, doomed)
                shutil.rmtree(doomed)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint {path} (newer than the resume point) could not be deleted "
                    f"({e}); move it out of the checkpoints folder"
                ) from None
            log.warning(
                "deleted checkpoint %s, newer than the resume point (checkpoint.overwrite_newer)",
                path,
            )
