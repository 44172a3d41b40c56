"""What the loop reports every trainer.log_every steps: the loss, throughput, MFU, memory per
rank (measured beside predicted) and skipped updates, to metrics.jsonl, TensorBoard and the
other loggers."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from dtrain.memory import PREDICTION_COMPARES, prediction_error_pct
from dtrain.reporting.metrics import Throughput, gather_memory, memory_scalars
from dtrain.reporting.summary import PREDICTED_SPEED_KEY
from dtrain.run.source_report import SourceReport

if TYPE_CHECKING:
    from dtrain.run.build import Run
    from dtrain.run.gc_schedule import GcSchedule

log = logging.getLogger("dtrain")


class StepReport:
    """The loop's running figures between two logged steps, and the report of each logged
    one. The only host-device sync of a normal step is in log(), every log_every steps."""

    def __init__(self, run: Run, gc_schedule: GcSchedule | None = None):
        self.run = run
        self.gc_schedule = gc_schedule  # its collections' pauses, for perf/gc_pct
        self.loss_sum = torch.zeros((), device=run.env.device)
        self.steps_since_log = 0
        self.throughput = Throughput()
        # Host time blocked on the loader since the last log, for perf/data_wait_pct.
        self.data_wait, self.t_log = 0.0, time.perf_counter()
        self.t_start = time.perf_counter()
        self.skipped_logged = 0
        self.prediction_logged = False
        self.losses: list[tuple[int, float]] = []  # (step, mean loss) of every logged step
        self.sources = SourceReport(run)

    def next_batches(self) -> list:
        """The next step's micro-batches, the time waited for them counted."""
        t_wait = time.perf_counter()
        micro_batches = self.run.stream.next_step()
        self.data_wait += time.perf_counter() - t_wait
        return micro_batches

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.float() / self.run.accum

    def restart_clock(self) -> None:
        """Throughput counts training only: restarted after an eval or a save."""
        self.throughput.restart()

    def step_done(self, step: int, lr: float, grad_norm: torch.Tensor) -> dict | None:
        """Count the step; on a logged one (every log_every, and the last) report it and
        return its record; None otherwise."""
        self.steps_since_log += 1
        self.throughput.add(self.run.tokens_per_step)
        if step % self.run.cfg.trainer.log_every and step != self.run.end_step:
            return None
        info = self._measure(step, lr, grad_norm)
        extra = self.run.strategy.step_metrics()  # e.g. fp16's overflow_steps and loss_scale
        info.update({k.split("/")[-1]: v for k, v in extra.items()})
        self._count_skipped(step, info)
        sources = self.sources.report(step, info)
        self.run.writer.scalars(step, {**extra, **self._scalars(info), **sources})
        self._compare_memory(step, info)
        self.run.writer.record(info)
        self.losses.append((step, info["loss"]))
        self.loss_sum.zero_()
        self.steps_since_log = 0
        return info

    def _measure(self, step: int, lr: float, grad_norm: torch.Tensor) -> dict:
        r = self.run
        world = r.env.world_size
        mean_loss = r.strategy.mean_across_ranks(self.loss_sum / self.steps_since_log).item()
        tok_s = self.throughput.report()
        mem = gather_memory(r.strategy.state_bytes(), r.env.device)
        mfu = (tok_s / world) * r.flops_per_token / r.peak if r.peak else None
        now = time.perf_counter()
        interval = max(now - self.t_log, 1e-9)
        data_wait_pct = 100.0 * self.data_wait / interval
        gc_s = self.gc_schedule.take() if self.gc_schedule is not None else 0.0
        self.data_wait, self.t_log = 0.0, now
        info = {
            "step": step,
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tok_s,
            "tokens_per_s_per_gpu": tok_s / world,
            "mfu": mfu,
            "data_wait_pct": data_wait_pct,
            "gc_pct": 100.0 * gc_s / interval,
            "tokens_seen": r.stream.consumed * r.cfg.trainer.seq_len,
            "elapsed_s": time.perf_counter() - self.t_start,
            "memory_per_rank": mem,
        }
        if r.speed is not None:  # the speed plan's figure beside the measured one
            info[PREDICTED_SPEED_KEY] = r.speed.tokens_per_s_per_gpu
        return info

    def _count_skipped(self, step: int, info: dict) -> None:
        skipped = self.run.guard.count()  # synced with the loss above: free here
        if skipped > self.skipped_logged:
            log.warning(
                "%d optimizer update(s) skipped for a non-finite gradient norm so far "
                "(trainer.on_nonfinite=%s)",
                skipped,
                self.run.cfg.trainer.on_nonfinite,
            )
            self.skipped_logged = skipped
        info["nonfinite_skipped"] = skipped
        self.run.writer.scalars(step, {"train/nonfinite_skipped": skipped})

    def _scalars(self, info: dict) -> dict:
        return {
            "train/loss": info["loss"],
            "train/lr": info["lr"],
            "train/grad_norm": info["grad_norm"],
            "perf/tokens_per_s": info["tokens_per_s"],
            "perf/tokens_per_s_per_gpu": info["tokens_per_s_per_gpu"],
            "perf/predicted_tokens_per_s_per_gpu": info.get(PREDICTED_SPEED_KEY),
            "perf/mfu": info["mfu"],
            "perf/data_wait_pct": info["data_wait_pct"],
            "perf/gc_pct": info["gc_pct"],
            **memory_scalars(info["memory_per_rank"], self.run.mem_plan),
        }

    def _compare_memory(self, step: int, info: dict) -> None:
        plan = self.run.mem_plan
        if step < 2 or plan is None:  # after warm-up: optimizer states exist, the peak is steady
            return
        err, what = prediction_error_pct(plan, info["memory_per_rank"])
        info["memory_prediction_error_pct"], info["memory_prediction_compares"] = err, what
        tag, words = PREDICTION_COMPARES[what]
        self.run.writer.scalars(step, {tag: err})
        if not self.prediction_logged:  # once: the number is steady after warm-up
            log.info("memory prediction vs measured (%s): %+.1f%%", words, err)
            self.prediction_logged = True
