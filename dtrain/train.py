"""The training loop: the one place where the pieces meet. Read it top to bottom.

cfg -> process group -> the run built once (dtrain/run/build.py) -> steps -> eval, save, stop
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys

import torch

from dtrain import dist as ddist
from dtrain.attention import attention_kernel
from dtrain.config import TrainConfig
from dtrain.data import eval_batches
from dtrain.determinism import deterministic
from dtrain.errors import FaultError
from dtrain.optim import lr_at
from dtrain.reliability.faults import point
from dtrain.reliability.preemption import OrphanWatch, StopSignal
from dtrain.reliability.rundir import hold_run_dir, mark_started
from dtrain.run.build import Resolved, Run, build_run
from dtrain.run.compile_cache import CompileCacheNote
from dtrain.run.gc_schedule import GcSchedule
from dtrain.run.oom import out_of_memory
from dtrain.run.report import StepReport
from dtrain.run.saving import Saver
from dtrain.run.slow_step import SlowStepNotice, SlowSteps

log = logging.getLogger("dtrain")


def run(cfg: TrainConfig) -> dict:
    """Train per `cfg`. Returns a summary (final step, last losses) for callers and tests."""
    from dtrain.strategies import STRATEGIES

    cls = STRATEGIES.get(cfg.strategy.name)
    # Stop signals are caught from the start, so that one during start-up (compiling, loading)
    # still ends in a save; the handlers are put back however the run ends (a bad-input error
    # raised half-way must not leave this run's handler behind for the next one in-process).
    stop = StopSignal(cfg.trainer.stop_signals)
    orphan = OrphanWatch(stop)
    env = heartbeat = None
    try:
        with (
            hold_run_dir(cfg.run_dir),
            deterministic(cfg.trainer.deterministic),
            contextlib.ExitStack() as on_exit,
        ):
            env = ddist.init_distributed(
                cfg.trainer.device,
                timeout_s=cfg.trainer.collective_timeout_s,
                force_group=bool(cls and cls.needs_distributed),
                expandable_segments=cfg.trainer.expandable_segments,
            )
            stop.attach(env.device, env.distributed)
            if env.distributed:
                from dtrain.reliability.watchdog import Heartbeat

                heartbeat = Heartbeat(env.rank, env.world_size, cfg.trainer.collective_timeout_s)
            resolved = Resolved(cfg)  # the config as the build resolves it, for OOM advice
            try:
                with attention_kernel(cfg.trainer.attention_kernel):
                    summary = train(build_run(cfg, env, on_exit, resolved), stop, heartbeat)
                # gloo's barrier waits for every op still in flight on this rank (FSDP2 issues
                # async ones): a group torn down with one pending aborted a rank now and then
                # ("terminate called without an active exception").
                ddist.barrier()
                return summary
            except torch.OutOfMemoryError as e:
                if heartbeat is not None:  # peers may be mid-collective: no teardown barrier
                    heartbeat.close()
                    heartbeat = None
                raise out_of_memory(resolved.cfg, env, e) from None
            except RuntimeError as e:
                from dtrain.reliability.watchdog import is_timeout

                if heartbeat is None or not is_timeout(e):
                    raise
                hung = heartbeat.timeout_error(e)
                heartbeat.close()  # its thread must not be in a store call at exit
                heartbeat = None  # a peer is gone: tearing the group down could block too
                raise hung from None
    finally:
        orphan.close()
        if heartbeat is not None:
            heartbeat.close()
            ddist.shutdown()
        elif env is not None and not env.distributed:
            ddist.shutdown()
        # Last: a second stop signal during the teardown above must not kill a rank that saved.
        stop.restore()


def one_step(r: Run, report: StepReport, step: int, heartbeat) -> tuple[float, float]:
    """Optimizer step `step + 1`: its micro-batches forward and backward, then the update;
    returns its learning rate and gradient norm."""
    point("train.step", step=step + 1)
    if heartbeat is not None:
        heartbeat.set_step(step + 1)
    if r.inject is not None:
        r.inject.before_step(step + 1)
    for i, (x, y) in enumerate(report.next_batches()):
        loss = r.strategy.forward_backward(x, y, last_micro=i == r.accum - 1, loss_div=r.accum)
        report.add_loss(loss)
    lr = lr_at(step, r.cfg.optim, r.cfg.trainer.max_steps)
    grad_norm = r.strategy.clip_and_step(lr, r.cfg.trainer.grad_clip)
    r.profiler.step()
    return lr, grad_norm


def say_already_trained(r: Run, step: int, end: int) -> None:
    """A resumed run whose checkpoint is at or past its last step trains nothing: said so."""
    key = "stop_at_step" if end < r.cfg.trainer.max_steps else "max_steps"
    log.warning(
        "%s is already trained to step %d (trainer.%s=%d): nothing to train; to train it "
        "further pass a larger trainer.max_steps with hydra.run.dir=%s",
        r.run_dir,
        step,
        key,
        end,
        r.run_dir,
    )


def train(r: Run, stop: StopSignal, heartbeat=None) -> dict:
    """Steps from r.start_step to r.end_step: eval, save and stop where they are due."""
    t = r.cfg.trainer
    step, end = r.start_step, r.end_step
    slow = SlowSteps(r.strategy, step + 1)  # compiling steps: said in the log while they run
    gc_schedule = GcSchedule(t.gc_every, compiling=slow)  # and collected after
    saver, report = Saver(r), StepReport(r, gc_schedule)
    progress = Progress(t.progress_bar and r.env.is_main, step, end)
    evals: list[tuple[int, float]] = []
    stopped_by_signal = False
    if r.strategy.compile_enabled and step < end:
        # Minutes of silence on a GPU otherwise: the first step is where torch.compile works
        # (the second where fp8's first step runs eagerly).
        at = "the first step" if slow.compiling_at == step + 1 else f"step {slow.compiling_at}"
        log.info(f"torch.compile: {at} compiles the model and may take a few minutes")
    if r.resume is not None and step >= end:
        say_already_trained(r, step, end)
    if step == 0 and t.eval_every > 0:
        evals.append((0, evaluate(r, 0)))
    report.restart_clock()
    r.profiler.start()

    with gc_schedule:  # Python's collector scheduled (or timed) while the steps run
        while step < end:
            compiling = r.strategy.compile_enabled and step + 1 == slow.compiling_at
            with SlowStepNotice(step + 1, slow.what(step + 1)):  # stopped however it ends
                with CompileCacheNote(step + 1, compiling and r.env.is_main):
                    lr, grad_norm = one_step(r, report, step, heartbeat)
            if step == r.start_step:  # trained: a later error no longer undoes the run dir
                mark_started(r.run_dir)
            step += 1
            # Before the report: a logged step waits for the GPU, and a collection made while
            # the GPU still runs the step's kernels costs it nothing.
            gc_schedule.step_done(step)
            info = report.step_done(step, lr, grad_norm)  # None but on a logged step
            progress.update(step, info)
            if r.ckpt.in_flight is not None:  # complete yet? (ranks agree where the loop syncs)
                saver.settle(step, sync_point=info is not None)

            if t.eval_every > 0 and step % t.eval_every == 0 and step != end:
                evals.append((step, evaluate(r, step)))
                report.restart_clock()
            bad_step = r.guard.poll() if t.on_nonfinite == "stop" else None
            if bad_step is not None:
                stop_on_nonfinite(r, saver, progress, step, bad_step)
            if stop.poll():
                stopped_by_signal = True
                saver.save(step, final=True)
                break
            if r.ckpt.due(step) and step != end:
                saver.save(step)
                report.restart_clock()

    r.profiler.stop()
    saver.settle(step)
    if not stopped_by_signal:
        if t.eval_every > 0 and (not evals or evals[-1][0] != step):
            evals.append((step, evaluate(r, step)))
        if (r.cfg.checkpoint.save_final or step < t.max_steps) and (
            r.resume is None or step > r.resume.step
        ):
            saver.save(step, final=True)  # also at stop_at_step, so the run can be resumed
    r.stream.close()  # (on an error, its __del__ does it when the frame goes)
    progress.close()
    final = r.writer.finish(step)  # the run's figures, as compare reads them (rank 0)
    return {
        "step": step,
        "losses": report.losses,
        "evals": evals,
        "stopped_by_signal": stopped_by_signal,
        "nonfinite_skipped": r.guard.count(),
        "save_failures": saver.failures,
        "n_params": r.n_params,
        "run_dir": str(r.run_dir),
        "summary": final,
    }


def stop_on_nonfinite(r: Run, saver: Saver, progress: Progress, step: int, bad_step: int):
    """trainer.on_nonfinite=stop: save the last good state and stop (FaultError, exit 3).
    The bad update was skipped, so the weights now are the last good state, unless a NaN
    came in where the norm does not look: the save checks and refuses that."""
    progress.close()
    cause = f"non-finite loss or gradient norm at step {bad_step}: the update was skipped"
    try:
        path = saver.save(step, final=True, cause=cause)
    finally:
        r.writer.close()
    raise FaultError(
        f"non-finite loss or gradient norm at step {bad_step}: the update was skipped "
        f"and the last good state saved at step {step} as {path}; stopping "
        "(trainer.on_nonfinite=stop; skip carries on past such steps)"
    )


def evaluate(r: Run, at_step: int) -> float:
    """The mean eval loss over ranks, logged with its perplexity; then the inspector's view."""
    t = r.cfg.trainer
    total = torch.zeros((), device=r.env.device)
    for x, y in eval_batches(
        r.data.eval,
        micro_batch_size=t.micro_batch_size,
        steps=t.eval_steps,
        rank=r.stream.rank,  # data-parallel: the ranks of one tp/cp group share a batch
        world_size=r.stream.world,
        device=r.env.device,
    ):
        total += r.strategy.eval_loss(x, y).float()
    loss = r.strategy.mean_across_ranks(total / t.eval_steps).item()
    ppl = math.exp(min(loss, 50.0))
    r.writer.scalars(at_step, {"eval/loss": loss, "eval/ppl": ppl})
    r.writer.record({"step": at_step, "eval_loss": loss, "eval_ppl": ppl})
    log.info("eval at step %d: loss %.4f, ppl %.2f", at_step, loss, ppl)
    # Samples and attention maps are hundreds of small forwards: kept out of a trace.
    r.inspector.on_eval(at_step, skip_reason="profiling" if r.profiler.recording else None)
    return loss


def bar_postfix(info: dict) -> dict:
    """What the bar shows after it: loss, lr, tokens/s, and MFU when there is a real peak."""
    out = {
        "loss": f"{info['loss']:.4f}",
        "lr": f"{info['lr']:.2e}",
        "tok/s": f"{info['tokens_per_s']:.0f}",
    }
    if info.get("mfu") is not None:
        out["mfu"] = f"{100 * info['mfu']:.1f}%"
    return out


class Progress:
    """A tqdm bar on an interactive terminal; plain log lines otherwise (CI, files)."""

    def __init__(self, enabled: bool, start: int, total: int, stream=None):
        self.bar = None
        self._redirect = None
        self.mfu_na_said = False
        stream = stream if stream is not None else sys.stderr
        if enabled and stream.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(
                total=total, initial=start, unit="step", dynamic_ncols=True, file=stream
            )
            # Log lines (eval, checkpoints, warnings) go through tqdm.write, above the bar,
            # instead of being cut into it.
            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()

    def update(self, step: int, info: dict | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if info:
                self.bar.set_postfix(bar_postfix(info), refresh=False)
        elif info:
            line = (
                f"step {step} | loss {info['loss']:.4f} | lr {info['lr']:.2e} | "
                f"grad_norm {info['grad_norm']:.3f} | {info['tokens_per_s']:.0f} tok/s"
            )
            if info["mfu"] is not None:
                line += f" | mfu {100 * info['mfu']:.1f}%"
            elif not self.mfu_na_said:  # once: no peak to divide by (a CPU, an unknown GPU)
                line += " | mfu n/a (no peak FLOP/s known: metrics.peak_tflops sets one)"
                self.mfu_na_said = True
            log.info("%s", line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
