"""Saving for the loop: the checkpoint of a step (never one holding a NaN), its report, and
checkpoint.on_error applied to a save that fails. At most one save is in flight."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain import dist as ddist
from dtrain.checkpoint import CheckpointSaveError, Saved, latest_complete
from dtrain.errors import FaultError
from dtrain.reliability.nonfinite import nonfinite_tensors
from dtrain.run.preflight import run_identity

if TYPE_CHECKING:
    from dtrain.run.build import Run

log = logging.getLogger("dtrain")


class Saver:
    def __init__(self, run: Run):
        self.run = run
        self.failures: list[int] = []  # steps whose save failed (checkpoint.on_error=continue)

    def save(self, at_step: int, final: bool = False, cause: str | None = None) -> Path | None:
        """Save the state at `at_step` (collective); its folder, or None while it is written
        in the background or after a failure tolerated. `final`: the run's last chance, so a
        failure is always an error; `cause` opens the message of a refused (poisoned) save."""
        r, on_error = self.run, self.run.cfg.checkpoint.on_error
        self.settle(at_step)  # at most one save in flight
        started = time.perf_counter()  # the stall counts the snapshot and the check too
        state, rank_state = r.strategy.state_dict(), r.strategy.rank_state()
        self._refuse_nonfinite(state, at_step, cause)
        # The stall's first part, apart from DCP's (Saved.dcp_s): an async save that stalls
        # nearly as long as a sync one then says which to look at.
        snapshot_s = time.perf_counter() - started
        manifest = {
            "identity": run_identity(r.cfg),
            "data": r.stream.state_dict(),
            "strategy": r.strategy.name,
            "precision": r.precision.name,
            "config": asdict(r.cfg),
        }
        timing = {"started": started, "snapshot_s": snapshot_s}
        try:
            if not final and r.ckpt.use_async(state):  # a final save has nothing to overlap
                r.ckpt.save_async(at_step, state, manifest, **timing, rank_state=rank_state)
                return None
            done = r.ckpt.save(at_step, state, manifest, **timing, rank_state=rank_state)
        except CheckpointSaveError as e:
            if on_error == "stop" or final:
                raise
            self._tolerate(e, at_step)
            return None
        self._saved(done, at_step)
        return done.path

    def settle(self, now: int, sync_point: bool | None = None) -> None:
        """The async save in flight: wait for it (None), or take it if done (at a sync_point
        under torchrun); reported, or its failure handled as save() handles its own. `now`:
        the loop's step."""
        at_step = self.run.ckpt.in_flight
        try:
            done = self.run.ckpt.finish() if sync_point is None else self.run.ckpt.poll(sync_point)
        except CheckpointSaveError as e:
            if self.run.cfg.checkpoint.on_error == "stop":
                raise
            self._tolerate(e, at_step)
            return
        if done is not None:
            self._saved(done, now)

    def _refuse_nonfinite(self, state: dict, at_step: int, cause: str | None) -> None:
        """A checkpoint never holds a NaN: saved, it would become the resume point, and
        keep_last would then prune the good ones."""
        counts = ddist.all_gather_object(nonfinite_tensors(state))
        poisoned = next(((r, c) for r, c in enumerate(counts) if c[0]), None)
        if poisoned is None:
            return
        rank, (n, names) = poisoned
        resume = self.run.resume
        prev = latest_complete(self.run.ckpt.root) or (resume.path if resume else None)
        raise FaultError(
            (f"{cause}, but " if cause else "")
            + f"the weights or optimizer state at step {at_step} hold non-finite values "
            f"({n} tensors on rank {rank}, e.g. {', '.join(names)}), so they were not "
            f"saved; the last good state is {prev or 'none (nothing was saved before)'}; "
            "stopping"
        )

    def _saved(self, s: Saved, now: int) -> None:
        """Report a complete checkpoint, with the time the loop was blocked by it."""
        writer = self.run.writer
        log.info("saved checkpoint %s", s.path)
        writer.scalars(s.step, {"checkpoint/stall_s": s.stall_s, "checkpoint/save_s": s.save_s})
        record = {"path": s.path.name, "async": s.background, "done_at_step": now}
        record.update(stall_s=s.stall_s, save_s=s.save_s)
        # The parts of the stall measured.
        for key in ("snapshot_s", "dcp_s", "at_save_s", "buffers_s"):
            if getattr(s, key) is not None:
                record[key] = getattr(s, key)
        writer.record({"step": s.step, "checkpoint": record})

    def _tolerate(self, e: CheckpointSaveError, at_step: int) -> None:
        """checkpoint.on_error=continue: the previous checkpoint stays the resume point."""
        self.failures.append(at_step)
        self.run.writer.scalars(at_step, {"checkpoint/save_failures": len(self.failures)})
        log.warning("%s; training continues (checkpoint.on_error=continue)", e)
