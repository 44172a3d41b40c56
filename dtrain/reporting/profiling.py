"""profile.enabled=true: torch.profiler over training steps, traces for TensorBoard, a table.

Every rank records its own trace (ranks differ: collectives wait on each other), written by
torch's tensorboard_trace_handler as <run_dir>/tensorboard/profile/rank{r}.<time>.pt.trace.json,
where TensorBoard's profiler plugin (pip install torch-tb-profiler) and Perfetto
(ui.perfetto.dev) read it. At the end rank 0 prints the top operators by self device time (self
CPU time on a CPU run) of the last recorded cycle, and writes the table next to the trace.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dtrain.config import ProfileConfig
from dtrain.reporting.allocator_snapshot import AllocatorSnapshot

log = logging.getLogger("dtrain")

TRACE_DIR = Path("tensorboard") / "profile"
TABLE_FILE = "profile_table.txt"


class StepProfiler:
    """start() before the loop, step() after each optimizer step, stop() after the loop."""

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, env):
        self.cfg, self.env = cfg, env
        self.run_dir = Path(run_dir)
        self.prof = None
        self.table: str | None = None
        self.traces = 0
        # The allocator's snapshot rides on the same hooks (profile.memory_snapshot_steps).
        self.snapshot = AllocatorSnapshot(cfg.memory_snapshot_steps, run_dir, env)

    @property
    def sort_key(self) -> str:
        return "self_device_time_total" if self.env.device.type == "cuda" else "self_cpu_time_total"

    def start(self) -> None:
        self.snapshot.start()
        if not self.cfg.enabled:
            return
        from torch.profiler import (
            ProfilerActivity,
            profile,
            schedule,
            tensorboard_trace_handler,
        )

        c = self.cfg
        activities = [ProfilerActivity.CPU]
        if self.env.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        trace_dir = self.run_dir / TRACE_DIR
        write_trace = tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{self.env.rank}")

        def on_ready(prof) -> None:
            write_trace(prof)
            self.traces += 1
            # Build the table now: after the next cycle starts, these events are gone.
            self.table = prof.key_averages().table(sort_by=self.sort_key, row_limit=c.row_limit)

        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=c.wait, warmup=c.warmup, active=c.active, repeat=c.repeat),
            on_trace_ready=on_ready,
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack,
        )
        self.prof.start()
        if self.env.is_main:
            log.info(
                "profiling: wait %d, warmup %d, record %d steps (x%s) -> %s",
                c.wait,
                c.warmup,
                c.active,
                c.repeat or "until the end",
                trace_dir,
            )

    @property
    def recording(self) -> bool:
        """Whether the current step is being traced (warmup or active)."""
        if self.prof is None:
            return False
        from torch.profiler import ProfilerAction

        return self.prof.current_action != ProfilerAction.NONE

    def step(self) -> None:
        self.snapshot.step()
        if self.prof is not None:
            self.prof.step()

    def stop(self) -> str | None:
        """End profiling (a cycle cut short by the end of training is still written) and print
        the table on rank 0. Returns the table."""
        self.snapshot.stop()
        if self.prof is None:
            return None
        self.prof.stop()
        self.prof = None
        if not self.env.is_main:
            return self.table
        if self.table is None:
            c = self.cfg
            log.warning(
                "profiling recorded nothing: the run ended within the first %d steps "
                "(profile.wait + profile.warmup); train longer or lower them",
                c.wait + c.warmup,
            )
            return None
        what = "self device time" if self.env.device.type == "cuda" else "self CPU time"
        print(f"\ntop operators by {what} (rank 0, last recorded cycle):\n{self.table}", flush=True)
        (self.run_dir / TABLE_FILE).write_text(self.table + "\n")
        return self.table
