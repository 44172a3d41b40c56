"""The training loop: the one place where the pieces meet. Read it top to bottom.

cfg -> process group -> precision -> strategy -> data -> model (+ resume) -> loop -> save
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dtrain import dist as ddist
from dtrain.attention import attention_kernel
from dtrain.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointSaveError,
    Saved,
    check_newer,
    latest_complete,
)
from dtrain.config import TrainConfig, resolve_grad_accum
from dtrain.data import BatchStream, build_data, eval_batches
from dtrain.errors import CheckpointError, ConfigError, FaultError
from dtrain.faults import NonfiniteInjector, point
from dtrain.inspector import Inspector
from dtrain.memory import (
    PREDICTION_COMPARES,
    markdown_breakdown,
    predicted_record,
    prediction_error_pct,
    run_prediction,
    summary_text,
)
from dtrain.metrics import (
    MetricsWriter,
    Throughput,
    gather_memory,
    memory_scalars,
    peak_flops,
)
from dtrain.model import count_params, flops_per_token
from dtrain.nonfinite import NonfiniteGuard, nonfinite_tensors
from dtrain.optim import lr_at, short_warmup_warning
from dtrain.precision import build_precision
from dtrain.preemption import OrphanWatch, StopSignal
from dtrain.profiling import StepProfiler
from dtrain.reporting.summary import run_hparams
from dtrain.reporting.tensorboard import run_name
from dtrain.rundir import hold_run_dir
from dtrain.strategies import build_strategy
from dtrain.topology import check_shared_dir, describe, gather_nodes, on_rank0

log = logging.getLogger("dtrain")

# Keys that must match between a checkpoint and the run resuming from it.
IDENTITY_KEYS = {
    "model": (
        "n_layer",
        "n_head",
        "n_kv_head",
        "d_model",
        "ffn_hidden",
        "vocab_size",
        "tie_embeddings",
        "rope",
    ),
    "data": ("source", "tokenizer"),
    "trainer": ("seq_len",),
}


def run_identity(cfg: TrainConfig) -> dict:
    return {
        f"{group}.{key}": getattr(getattr(cfg, group), key)
        for group, keys in IDENTITY_KEYS.items()
        for key in keys
    }


def resolve_resume(cfg: TrainConfig, ckpt: CheckpointManager) -> Path | None:
    """Which checkpoint to start from; refuses to overwrite another run's checkpoints, or
    this run's newer ones (unless checkpoint.overwrite_newer). resume=auto sets aside the
    newer ones it skipped as bad, so that no save or pruning touches them."""
    latest = latest_complete(ckpt.root)
    if cfg.resume == "never":
        if latest is not None:
            raise ConfigError(
                f"run dir {cfg.run_dir} already holds checkpoints ({latest.name}); resume=never "
                "would overwrite them: use resume=auto to continue, or a new hydra.run.dir"
            )
        return None

    def same_run(path: Path, manifest: dict) -> None:
        saved = manifest.get("identity", {})
        for key, value in run_identity(cfg).items():
            if key in saved and saved[key] != value:
                hint = (
                    "choose a new hydra.run.dir for a new run"
                    if cfg.resume == "auto"
                    else "resume it with the config it was trained with"
                )
                raise CheckpointMismatchError(
                    f"checkpoint {path} was saved with {key}={saved[key]!r} but this run has "
                    f"{key}={value!r}; {hint}"
                )

    if cfg.resume == "auto":  # newest intact one; corrupt ones are skipped, with a warning
        found = ckpt.find_resumable(accept=same_run)
        if found:
            ckpt.set_aside(ckpt.rejected)
        return found[0] if found else None
    path = Path(cfg.resume)
    manifest = CheckpointManager.read_manifest(path)
    same_run(path, manifest)
    check_newer(ckpt.root, path, manifest["step"], cfg.checkpoint.overwrite_newer)
    return path


def setup_logging(is_main: bool) -> None:
    level = logging.INFO if is_main else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s %(name)s] %(message)s", force=True)
    log.setLevel(level)


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
            log.info(
                "step %d | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s | mfu %s",
                step,
                info["loss"],
                info["lr"],
                info["grad_norm"],
                info["tokens_per_s"],
                "n/a" if info["mfu"] is None else f"{100 * info['mfu']:.1f}%",
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def evaluate(strategy, data, cfg: TrainConfig, env) -> float:
    t = cfg.trainer
    total = torch.zeros((), device=env.device)
    for x, y in eval_batches(
        data.eval,
        micro_batch_size=t.micro_batch_size,
        steps=t.eval_steps,
        rank=env.rank,
        world_size=env.world_size,
        device=env.device,
    ):
        total += strategy.eval_loss(x, y).float()
    return strategy.mean_across_ranks(total / t.eval_steps).item()


def log_memory_prediction(
    cfg: TrainConfig, precision, strategy, env, writer, step: int, run_info: dict
):
    """Predicted memory per GPU, logged at the start (a text table `memory/predicted`;
    `run` and `memory_predicted` in metrics.jsonl). Returns the plan, which every logged step
    puts beside the measured memory (memory/predicted/*)."""
    compile_enabled = bool(getattr(strategy, "compile_enabled", False))
    try:
        plan, setup = run_prediction(cfg, precision, env, compile_enabled)
    except ConfigError as e:  # a strategy the planner does not know yet: train anyway
        log.warning("memory: no prediction for this run: %s", e)
        return None
    text = summary_text(plan, setup, cfg.model)
    log.info("memory: %s", text)
    if step == 0:
        writer.text("memory/predicted", markdown_breakdown(plan, text), 0)
        writer.record({"step": 0, "run": run_info, "memory_predicted": predicted_record(plan)})
    return plan


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
        with hold_run_dir(cfg.run_dir), contextlib.ExitStack() as on_exit:
            env = ddist.init_distributed(
                cfg.trainer.device,
                timeout_s=cfg.trainer.collective_timeout_s,
                force_group=bool(cls and cls.needs_distributed),
                expandable_segments=cfg.trainer.expandable_segments,
            )
            stop.attach(env.device, env.distributed)
            if env.distributed:
                from dtrain.watchdog import Heartbeat

                heartbeat = Heartbeat(env.rank, env.world_size, cfg.trainer.collective_timeout_s)
            try:
                with attention_kernel(cfg.trainer.attention_kernel):
                    summary = _run(cfg, env, stop, heartbeat=heartbeat, on_exit=on_exit)
                # gloo's barrier waits for every op still in flight on this rank (FSDP2 issues
                # async ones): a group torn down with one pending aborted a rank now and then
                # ("terminate called without an active exception").
                ddist.barrier()
                return summary
            except RuntimeError as e:
                from dtrain.watchdog import is_timeout

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


def _run(
    cfg: TrainConfig,
    env: ddist.DistEnv,
    stop: StopSignal,
    heartbeat=None,
    on_exit: contextlib.ExitStack | None = None,
) -> dict:
    setup_logging(env.is_main)
    nodes = gather_nodes(env) if env.distributed else None
    if cfg.model.init_from:  # the architecture comes from the directory we start from
        from dtrain.hf import model_config_from_hf, parse_init_from

        cfg = replace(
            cfg, model=model_config_from_hf(parse_init_from(cfg.model.init_from), cfg.model)
        )
    t = cfg.trainer
    precision = build_precision(cfg.precision, env.device)
    precision.apply_backend_flags(env.device)
    strategy = build_strategy(cfg.strategy, precision, env)
    accum = resolve_grad_accum(t, env.world_size)
    global_batch = t.micro_batch_size * accum * env.world_size

    data = build_data(
        cfg.data,
        seq_len=t.seq_len,
        seed=cfg.seed,
        device=env.device,
        is_main=env.is_main,
        run_dir=cfg.run_dir,
    )
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < data.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{data.vocab_size}; leave it unset to follow the tokenizer"
        )
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=cfg.model.vocab_size or data.vocab_size))

    run_dir = Path(cfg.run_dir)
    ckpt = CheckpointManager(
        run_dir, cfg.checkpoint, env.rank, env.world_size, timeout_s=t.collective_timeout_s
    )
    if on_exit is not None:  # however the run ends, no save is left writing behind it
        on_exit.callback(ckpt.close)
    # Every rank must resume from the same checkpoint, and see the folder rank 0 completes.
    check_shared_dir(run_dir, env)
    # Rank 0 decides alone (a manager of world size 1 verifies without collectives, which
    # the other ranks, waiting in on_rank0's broadcast, could not join).
    alone = CheckpointManager(run_dir, cfg.checkpoint, 0, 1)
    resume_path = on_rank0(env, lambda: resolve_resume(cfg, alone))
    if resume_path is not None and cfg.resume == "auto" and cfg.checkpoint.verify:
        ckpt._verified.add(resume_path)  # rank 0 hashed it already: don't read it twice

    ddist.seed_everything(cfg.seed)
    strategy.configure(
        micro_batch_size=t.micro_batch_size, grad_accum_steps=accum, grad_clip=t.grad_clip
    )
    strategy.setup(cfg.model, cfg.optim, cfg.seed)
    stream = BatchStream(
        data.train,
        micro_batch_size=t.micro_batch_size,
        grad_accum_steps=accum,
        rank=env.rank,
        world_size=env.world_size,
        seed=cfg.seed,
        device=env.device,
    )
    step = 0
    if resume_path is not None:
        state = strategy.state_dict()
        manifest = ckpt.load(resume_path, state)
        strategy.load_state_dict(state)
        try:
            stream.load_state_dict(manifest["data"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # JSON of the wrong shape
            raise CheckpointError(
                f"checkpoint {resume_path}: manifest.json's data position is malformed "
                f"({type(e).__name__}: {e}); it was not written by dtrain"
            ) from None
        step = int(manifest["step"])
        log.info("resumed from %s (step %d)", resume_path, step)
        if cfg.checkpoint.overwrite_newer and env.is_main:  # resolve_resume refused otherwise
            ckpt.remove_newer(step)
    elif cfg.model.init_from:
        from dtrain.hf import load_hf_into, parse_init_from

        load_hf_into(strategy.unwrapped(), parse_init_from(cfg.model.init_from))
        log.info("initialised the weights from %s", cfg.model.init_from)

    end_step = min(t.max_steps, t.stop_at_step or t.max_steps)
    n_params = count_params(cfg.model)
    fpt = flops_per_token(cfg.model, t.seq_len)
    peak = peak_flops(env.device, cfg.metrics)
    tokens_per_step = global_batch * t.seq_len
    name = run_name(strategy.name, precision.name, env.world_size, cfg.model.name)
    writer = MetricsWriter(run_dir, env, cfg.metrics, start_step=step, run_name=name)
    hparams = run_hparams(
        cfg,
        strategy=strategy.name,
        precision=precision.name,
        env=env,
        grad_accum_steps=accum,
        n_params=n_params,
        compile_enabled=bool(getattr(strategy, "compile_enabled", False)),
    )
    writer.start(hparams, asdict(cfg), cuda=env.device.type == "cuda", mfu=peak is not None)
    if nodes is not None:
        log.info("ranks: %s", describe(nodes))
    if env.device.type == "cuda":
        log.info("CUDA allocator: %s", env.allocator)
    inspector = Inspector(cfg.inspect, strategy, data.tokenizer, writer, env)
    profiler = StepProfiler(cfg.profile, run_dir, env)
    if step == 0:
        writer.text("config", "```\n" + json.dumps(asdict(cfg), indent=1) + "\n```", 0)
    mem_plan = log_memory_prediction(cfg, precision, strategy, env, writer, step, hparams)
    log.info(
        "%s | %s | world %d | model %s: %.2fM params, %.3g FLOPs/token | global batch %d x %d "
        "tokens | run dir %s",
        strategy.name,
        precision.name,
        env.world_size,
        cfg.model.name,
        n_params / 1e6,
        fpt,
        global_batch,
        t.seq_len,
        run_dir,
    )
    warmup_warning = short_warmup_warning(cfg.optim, t.max_steps)
    if warmup_warning and env.is_main:  # a choice the user may mean (a smoke test): warn, run
        log.warning(warmup_warning)

    save_failures: list[int] = []

    def saved(s: Saved) -> None:
        """Report a complete checkpoint, with the time the loop was blocked by it."""
        log.info("saved checkpoint %s", s.path)
        writer.scalars(s.step, {"checkpoint/stall_s": s.stall_s, "checkpoint/save_s": s.save_s})
        record = {"path": s.path.name, "async": s.background, "done_at_step": step}
        record.update(stall_s=s.stall_s, save_s=s.save_s)
        writer.record({"step": s.step, "checkpoint": record})

    def tolerate(e: CheckpointSaveError, at_step: int) -> None:  # checkpoint.on_error=continue
        save_failures.append(at_step)
        writer.scalars(at_step, {"checkpoint/save_failures": len(save_failures)})
        log.warning("%s; training continues (checkpoint.on_error=continue)", e)

    def settle(sync_point: bool | None = None) -> None:
        """The async save in flight: wait for it (None), or take it if done (at a sync_point
        under torchrun); reported, or its failure handled as save() handles its own."""
        at_step = ckpt.in_flight
        try:
            done = ckpt.finish() if sync_point is None else ckpt.poll(sync_point)
        except CheckpointSaveError as e:
            if cfg.checkpoint.on_error == "stop":
                raise
            tolerate(e, at_step)
            return
        if done is not None:
            saved(done)

    def save(at_step: int, final: bool = False, cause: str | None = None) -> Path | None:
        settle()  # at most one save in flight
        started = time.perf_counter()  # the stall counts the snapshot and the check too
        state = strategy.state_dict()
        # A checkpoint never holds a NaN: saved, it would become the resume point, and
        # keep_last would then prune the good ones. `cause` opens the message if it does.
        counts = ddist.all_gather_object(nonfinite_tensors(state))
        poisoned = next(((r, c) for r, c in enumerate(counts) if c[0]), None)
        if poisoned is not None:
            rank, (n, names) = poisoned
            prev = latest_complete(ckpt.root) or resume_path
            raise FaultError(
                (f"{cause}, but " if cause else "")
                + f"the weights or optimizer state at step {at_step} hold non-finite values "
                f"({n} tensors on rank {rank}, e.g. {', '.join(names)}), so they were not "
                f"saved; the last good state is {prev or 'none (nothing was saved before)'}; "
                "stopping"
            )
        manifest = {
            "identity": run_identity(cfg),
            "data": stream.state_dict(),
            "strategy": strategy.name,
            "precision": precision.name,
            "config": asdict(cfg),
        }
        try:
            if cfg.checkpoint.async_save and not final:  # a final save has nothing to overlap
                ckpt.save_async(at_step, state, manifest, started=started)
                return None
            done = ckpt.save(at_step, state, manifest, started=started)
        except CheckpointSaveError as e:
            # A final save (end of run, signal, stop) has no later chance: always an error.
            if cfg.checkpoint.on_error == "stop" or final:
                raise
            tolerate(e, at_step)
            return None
        saved(done)
        return done.path

    def do_eval(at_step: int) -> float:
        loss = evaluate(strategy, data, cfg, env)
        ppl = math.exp(min(loss, 50.0))
        writer.scalars(at_step, {"eval/loss": loss, "eval/ppl": ppl})
        writer.record({"step": at_step, "eval_loss": loss, "eval_ppl": ppl})
        log.info("eval at step %d: loss %.4f, ppl %.2f", at_step, loss, ppl)
        # Samples and attention maps are hundreds of small forwards: kept out of a trace.
        inspector.on_eval(at_step, skip_reason="profiling" if profiler.recording else None)
        return loss

    guard = NonfiniteGuard(t.on_nonfinite, env.device, start_step=step)
    strategy.nonfinite = guard
    inject = None
    if cfg.debug.inject_nonfinite_at_step is not None:
        inject = NonfiniteInjector(
            strategy.unwrapped(),
            cfg.debug.inject_nonfinite_at_step,
            cfg.debug.inject_nonfinite_rank,
            env.rank,
        )
    skipped_logged = 0
    prediction_logged = False
    progress = Progress(t.progress_bar and env.is_main, step, end_step)
    throughput = Throughput()
    eval_history: list[tuple[int, float]] = []
    loss_history: list[tuple[int, float]] = []
    loss_sum = torch.zeros((), device=env.device)
    steps_since_log = 0
    # Host time blocked on the loader since the last log, for perf/data_wait_pct.
    data_wait, t_log = 0.0, time.perf_counter()
    stopped_by_signal = False
    t_start = time.perf_counter()

    if getattr(strategy, "compile_enabled", False) and step < end_step:
        # Minutes of silence on a GPU otherwise: the first step is where torch.compile works.
        log.info("torch.compile: the first step compiles the model and may take a few minutes")
    if step == 0 and t.eval_every > 0:
        eval_history.append((0, do_eval(0)))
    throughput.restart()
    profiler.start()

    while step < end_step:
        point("train.step", step=step + 1)
        if heartbeat is not None:
            heartbeat.set_step(step + 1)
        if inject is not None:
            inject.before_step(step + 1)
        t_wait = time.perf_counter()
        micro_batches = stream.next_step()
        data_wait += time.perf_counter() - t_wait
        for i, (x, y) in enumerate(micro_batches):
            loss = strategy.forward_backward(x, y, last_micro=i == accum - 1, loss_div=accum)
            loss_sum += loss.float() / accum
        lr = lr_at(step, cfg.optim, t.max_steps)
        grad_norm = strategy.clip_and_step(lr, t.grad_clip)
        profiler.step()
        step += 1
        steps_since_log += 1
        throughput.add(tokens_per_step)

        info = None
        if step % t.log_every == 0 or step == end_step:
            # The only host-device sync of a normal step happens here, every log_every steps.
            mean_loss = strategy.mean_across_ranks(loss_sum / steps_since_log).item()
            tok_s = throughput.report()
            mem = gather_memory(strategy.state_bytes(), env.device)
            mfu = (tok_s / env.world_size) * fpt / peak if peak else None
            now = time.perf_counter()
            data_wait_pct = 100.0 * data_wait / max(now - t_log, 1e-9)
            data_wait, t_log = 0.0, now
            info = {
                "step": step,
                "loss": mean_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tok_s,
                "tokens_per_s_per_gpu": tok_s / env.world_size,
                "mfu": mfu,
                "data_wait_pct": data_wait_pct,
                "tokens_seen": stream.consumed * t.seq_len,
                "elapsed_s": time.perf_counter() - t_start,
                "memory_per_rank": mem,
            }
            extra = strategy.step_metrics()  # e.g. fp16's overflow_steps and loss_scale
            info.update({k.split("/")[-1]: v for k, v in extra.items()})
            skipped = guard.count()  # synced with the loss above: free here
            if skipped > skipped_logged:
                log.warning(
                    "%d optimizer update(s) skipped for a non-finite gradient norm so far "
                    "(trainer.on_nonfinite=%s)",
                    skipped,
                    t.on_nonfinite,
                )
                skipped_logged = skipped
            info["nonfinite_skipped"] = skipped
            writer.scalars(step, {"train/nonfinite_skipped": skipped})
            writer.scalars(
                step,
                {
                    **extra,
                    "train/loss": mean_loss,
                    "train/lr": lr,
                    "train/grad_norm": info["grad_norm"],
                    "perf/tokens_per_s": tok_s,
                    "perf/tokens_per_s_per_gpu": tok_s / env.world_size,
                    "perf/mfu": mfu,
                    "perf/data_wait_pct": data_wait_pct,
                    **memory_scalars(mem, mem_plan),
                },
            )
            # After warm-up: optimizer states exist, the peak is steady.
            if step >= 2 and mem_plan is not None:
                err, what = prediction_error_pct(mem_plan, mem)
                info["memory_prediction_error_pct"], info["memory_prediction_compares"] = err, what
                tag, words = PREDICTION_COMPARES[what]
                writer.scalars(step, {tag: err})
                if not prediction_logged:  # once: the number is steady after warm-up
                    log.info("memory prediction vs measured (%s): %+.1f%%", words, err)
                    prediction_logged = True
            writer.record(info)
            loss_history.append((step, mean_loss))
            loss_sum.zero_()
            steps_since_log = 0
        progress.update(step, info)
        if ckpt.in_flight is not None:  # complete yet? (ranks agree where the loop syncs)
            settle(sync_point=info is not None)

        if t.eval_every > 0 and step % t.eval_every == 0 and step != end_step:
            eval_history.append((step, do_eval(step)))
            throughput.restart()
        bad_step = guard.poll() if t.on_nonfinite == "stop" else None
        if bad_step is not None:
            # The bad update was skipped, so the weights now are the last good state, unless
            # a NaN came in where the norm does not look: save() checks and refuses that.
            progress.close()
            cause = f"non-finite loss or gradient norm at step {bad_step}: the update was skipped"
            try:
                path = save(step, final=True, cause=cause)
            finally:
                writer.close()
            raise FaultError(
                f"non-finite loss or gradient norm at step {bad_step}: the update was skipped "
                f"and the last good state saved at step {step} as {path}; stopping "
                "(trainer.on_nonfinite=stop; skip carries on past such steps)"
            )
        if stop.poll():
            stopped_by_signal = True
            save(step, final=True)
            break
        if ckpt.due(step) and step != end_step:
            save(step)
            throughput.restart()

    profiler.stop()
    settle()
    if not stopped_by_signal:
        if t.eval_every > 0 and (not eval_history or eval_history[-1][0] != step):
            eval_history.append((step, do_eval(step)))
        if (cfg.checkpoint.save_final or step < t.max_steps) and (
            resume_path is None or step > int(manifest["step"])
        ):
            save(step, final=True)  # also at stop_at_step, so the run can be resumed
    stream.close()  # (on an error, its __del__ does it when the frame goes)
    progress.close()
    final = writer.finish(step)  # the run's figures, as compare reads them (rank 0)
    return {
        "step": step,
        "losses": loss_history,
        "evals": eval_history,
        "stopped_by_signal": stopped_by_signal,
        "nonfinite_skipped": guard.count(),
        "save_failures": save_failures,
        "n_params": n_params,
        "run_dir": str(run_dir),
        "summary": final,
    }
