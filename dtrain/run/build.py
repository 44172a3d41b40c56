"""The run, built once: every piece the loop needs and the numbers derived from the config,
in one Run value. Order matters and is written here only: precision -> strategy -> data (the
vocab) -> checkpoints and the resume point -> model (+ resumed state) -> reporters."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

from dtrain import dist as ddist
from dtrain.checkpoint import CheckpointManager
from dtrain.config import TrainConfig, resolve_grad_accum
from dtrain.data import BatchStream, DataBundle, build_data
from dtrain.errors import CheckpointError, ConfigError, DataError
from dtrain.evaluation import DownstreamEval, build_downstream
from dtrain.memory import (
    MemoryPlan,
    SpeedPlan,
    markdown_breakdown,
    predicted_record,
    predicted_speed_record,
    run_prediction,
    run_speed_prediction,
    summary_lines,
)
from dtrain.model import count_params, flops_per_token
from dtrain.optim import short_warmup_warning
from dtrain.parallel.mesh import data_coords
from dtrain.precision import Precision, build_precision, fp8_scaling_note
from dtrain.reliability.faults import NonfiniteInjector
from dtrain.reliability.nonfinite import NonfiniteGuard
from dtrain.reporting.inspector import Inspector
from dtrain.reporting.metrics import MetricsWriter, peak_flops
from dtrain.reporting.profiling import StepProfiler
from dtrain.reporting.summary import run_hparams
from dtrain.reporting.tensorboard import run_name
from dtrain.run.preflight import ResumePoint, resolve_resume
from dtrain.strategies import Strategy, build_strategy, check_parallel, strategy_class
from dtrain.topology import check_shared_dir, describe, gather_nodes, on_rank0

log = logging.getLogger("dtrain")


@dataclass
class Run:
    """Everything a training run is made of, built once by build_run."""

    cfg: TrainConfig  # with the model's vocab (and an init_from architecture) filled in
    env: ddist.DistEnv
    precision: Precision
    strategy: Strategy
    data: DataBundle
    stream: BatchStream
    ckpt: CheckpointManager
    writer: MetricsWriter
    inspector: Inspector
    profiler: StepProfiler
    downstream: DownstreamEval | None  # downstream.every=0: None
    guard: NonfiniteGuard
    inject: NonfiniteInjector | None  # debug.inject_nonfinite_at_step
    resume: ResumePoint | None
    start_step: int
    end_step: int  # trainer.stop_at_step, else trainer.max_steps
    accum: int  # micro-steps per optimizer step
    global_batch: int  # sequences per optimizer step, all ranks
    tokens_per_step: int
    n_params: int
    flops_per_token: float
    peak: float | None  # FLOP/s of one device, for MFU (None: no real peak known)
    mem_plan: MemoryPlan | None  # the predicted memory per GPU, beside the measured
    speed: SpeedPlan | None  # the predicted step time and tokens/s per GPU (None off known GPUs)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)


def setup_logging(is_main: bool) -> None:
    level = logging.INFO if is_main else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s %(name)s] %(message)s", force=True)
    log.setLevel(level)


@dataclass
class Resolved:
    """The run's config as build_run has resolved it so far (the architecture of
    model.init_from, the vocab, the auto options): what an out-of-memory error during the
    build or the steps is planned for."""

    cfg: TrainConfig


def build_run(
    cfg: TrainConfig,
    env: ddist.DistEnv,
    on_exit: contextlib.ExitStack | None = None,
    resolved: Resolved | None = None,
) -> Run:
    """Build every piece of the run in order; resumes its state from the resume point.
    `resolved.cfg` follows the config as it is resolved."""
    resolved = resolved or Resolved(cfg)
    setup_logging(env.is_main)
    nodes = gather_nodes(env) if env.distributed else None
    cfg = resolved.cfg = with_init_from(cfg)
    precision = build_checked_precision(cfg, env)
    data = build_data(
        cfg.data,
        seq_len=cfg.trainer.seq_len,
        seed=cfg.seed,
        device=env.device,
        is_main=env.is_main,
        run_dir=cfg.run_dir,
    )
    cfg = resolved.cfg = with_auto_options(with_vocab(cfg, data.vocab_size), env)
    strategy = build_strategy(cfg.strategy, precision, env)
    t = cfg.trainer
    dp = data_coords(env.rank, env.world_size, cfg.parallel)  # ranks of one replica: one batch
    accum = resolve_grad_accum(t, dp.world)
    ckpt, resume = open_checkpoints(cfg, env, on_exit)
    start_step = resume.step if resume is not None else 0
    guard = NonfiniteGuard(t.on_nonfinite, env.device, start_step=start_step)
    setup_strategy(strategy, cfg, grad_accum_steps=accum, nonfinite=guard)
    stream = BatchStream(
        data.train,
        micro_batch_size=t.micro_batch_size,
        grad_accum_steps=accum,
        rank=dp.rank,
        world_size=dp.world,
        seed=cfg.seed,
        device=env.device,
        copies=dp.copies,
    )
    load_state(cfg, env, strategy, stream, ckpt, resume)
    numbers = run_numbers(cfg, env, grad_accum_steps=accum, data_world=dp.world)
    reporters = start_reporting(
        cfg, env, strategy, precision, data, start_step, nodes, on_exit, **numbers
    )
    return Run(
        cfg=cfg,
        env=env,
        precision=precision,
        strategy=strategy,
        data=data,
        stream=stream,
        ckpt=ckpt,
        guard=guard,
        inject=injector(cfg, strategy, env),
        resume=resume,
        start_step=start_step,
        end_step=min(t.max_steps, t.stop_at_step or t.max_steps),
        tokens_per_step=numbers["global_batch"] * t.seq_len,
        **reporters._asdict(),
        **numbers,
    )


def build_checked_precision(cfg: TrainConfig, env: ddist.DistEnv) -> Precision:
    """The precision, built for the chosen strategy, then that strategy's refusals and the
    parallel layout's: all before the data is built (the strategy itself is built once the
    memory plan has decided its auto options)."""
    precision_cfg, strategy_cfg = cfg.precision, cfg.strategy
    chosen = strategy_class(strategy_cfg.name)
    sharded = chosen.shards_params(strategy_cfg.name)
    precision = build_precision(precision_cfg, env.device, shards_params=sharded)
    if note := fp8_scaling_note(precision_cfg, precision, sharded):
        log.info("%s", note)
    precision.apply_backend_flags(env.device)
    chosen.check_installed(strategy_cfg)
    chosen.check_config(strategy_cfg, precision, env.device.type)
    chosen.check_world(strategy_cfg, env.world_size)
    check_parallel(
        strategy_cfg,
        cfg.parallel,
        precision,
        world_size=env.world_size,
        model=cfg.model,
        seq_len=cfg.trainer.seq_len,
    )
    return precision


def open_checkpoints(
    cfg: TrainConfig, env: ddist.DistEnv, on_exit: contextlib.ExitStack | None
) -> tuple[CheckpointManager, ResumePoint | None]:
    """The run's checkpoint manager (closed on exit) and the point it resumes from."""
    ckpt = CheckpointManager(
        cfg.run_dir,
        cfg.checkpoint,
        env.rank,
        env.world_size,
        timeout_s=cfg.trainer.collective_timeout_s,
    )
    if on_exit is not None:  # however the run ends, no save is left writing behind it
        on_exit.callback(ckpt.close)
    return ckpt, resume_point(cfg, env, ckpt)


def setup_strategy(
    strategy: Strategy, cfg: TrainConfig, *, grad_accum_steps: int, nonfinite: NonfiniteGuard
) -> None:
    """Seed every generator, then build the model and its optimizer inside the strategy."""
    ddist.seed_everything(cfg.seed)
    strategy.configure(
        micro_batch_size=cfg.trainer.micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        grad_clip=cfg.trainer.grad_clip,
        nonfinite=nonfinite,
        parallel=cfg.parallel,
        seq_len=cfg.trainer.seq_len,
    )
    strategy.setup(cfg.model, cfg.optim, cfg.seed)


def run_numbers(
    cfg: TrainConfig, env: ddist.DistEnv, *, grad_accum_steps: int, data_world: int
) -> dict:
    """The numbers derived from the config that the reporters and the loop share;
    `data_world`: the data-parallel replicas, each reading its own batch."""
    return dict(
        accum=grad_accum_steps,
        global_batch=cfg.trainer.micro_batch_size * grad_accum_steps * data_world,
        n_params=count_params(cfg.model),
        flops_per_token=flops_per_token(cfg.model, cfg.trainer.seq_len),
        peak=peak_flops(env.device, cfg.metrics),
    )


def with_init_from(cfg: TrainConfig) -> TrainConfig:
    """model.init_from: the architecture comes from the directory the run starts from."""
    if not cfg.model.init_from:
        return cfg
    from dtrain.hf import model_config_from_hf, parse_init_from

    return replace(cfg, model=model_config_from_hf(parse_init_from(cfg.model.init_from), cfg.model))


def with_vocab(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    """The model's vocab: the tokenizer's (padded), unless model.vocab_size is set larger."""
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{vocab_size}; leave it unset to follow the tokenizer"
        )
    return replace(cfg, model=replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size))


def with_auto_options(cfg: TrainConfig, env: ddist.DistEnv) -> TrainConfig:
    """trainer.micro_batch_size=auto and strategy.reshard_after_forward=auto, decided by the
    memory plan for the smallest device of the world (each logged): the plan is pure, so every
    rank decides the same, even on cards of different sizes, where deciding by each rank's own
    card would build FSDP differently on each and hang its first collective."""
    from dtrain.memory.search import auto_to_decide, device_capacity, resolve_auto_options

    if not auto_to_decide(cfg):
        return cfg  # no collective either: every rank has the same config, so skips alike
    capacity = min(ddist.all_gather_object(device_capacity(env.device)))
    cfg, notes = resolve_auto_options(cfg, env.world_size, env.device, capacity_bytes=capacity)
    for note in notes:
        log.info("%s", note)
    return cfg


def resume_point(
    cfg: TrainConfig, env: ddist.DistEnv, ckpt: CheckpointManager
) -> ResumePoint | None:
    """Where the run starts, decided by rank 0 for every rank."""
    # Every rank must resume from the same checkpoint, and see the folder rank 0 completes.
    check_shared_dir(Path(cfg.run_dir), env)
    # Rank 0 decides alone (a manager of world size 1 verifies without collectives, which
    # the other ranks, waiting in on_rank0's broadcast, could not join).
    alone = CheckpointManager(cfg.run_dir, cfg.checkpoint, 0, 1)
    resume = on_rank0(env, lambda: resolve_resume(cfg, alone))
    if resume is not None and cfg.resume == "auto" and cfg.checkpoint.verify:
        ckpt.trust(resume.path)  # rank 0 hashed it already: don't read it twice
    return resume


def load_state(
    cfg: TrainConfig,
    env: ddist.DistEnv,
    strategy: Strategy,
    stream: BatchStream,
    ckpt: CheckpointManager,
    resume: ResumePoint | None,
) -> None:
    """The model, optimizer and data position from the resume point, or the weights of
    model.init_from; nothing for a fresh run."""
    if resume is not None:
        state = strategy.state_dict()
        loaded = ckpt.load(resume.path, state)
        strategy.load_state_dict(state)
        strategy.load_rank_state(loaded.rank_state, from_rank=loaded.from_rank)
        manifest = loaded.manifest
        try:
            stream.load_state_dict(manifest["data"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # JSON of the wrong shape
            raise CheckpointError(
                f"checkpoint {resume.path}: manifest.json's data position is malformed "
                f"({type(e).__name__}: {e}); it was not written by dtrain"
            ) from None
        except DataError as e:  # a position this data config cannot take up: name the checkpoint
            raise DataError(f"checkpoint {resume.path}: {e}") from None
        log.info("resumed from %s (step %d)", resume.path, resume.step)
        if cfg.checkpoint.overwrite_newer and env.is_main:  # resolve_resume refused otherwise
            ckpt.remove_newer(resume.step)
    elif cfg.model.init_from:
        from dtrain.hf import load_hf_into, parse_init_from

        load_hf_into(strategy.unwrapped(), parse_init_from(cfg.model.init_from))
        log.info("initialised the weights from %s", cfg.model.init_from)


def injector(cfg: TrainConfig, strategy: Strategy, env: ddist.DistEnv):
    """debug.inject_nonfinite_at_step: the fault injector the loop calls before each step."""
    if cfg.debug.inject_nonfinite_at_step is None:
        return None
    return NonfiniteInjector(
        strategy.unwrapped(),
        cfg.debug.inject_nonfinite_at_step,
        cfg.debug.inject_nonfinite_rank,
        env.rank,
    )


class Reporters(NamedTuple):
    writer: MetricsWriter
    inspector: Inspector
    profiler: StepProfiler
    downstream: DownstreamEval | None
    mem_plan: MemoryPlan | None
    speed: SpeedPlan | None


def start_reporting(
    cfg: TrainConfig,
    env: ddist.DistEnv,
    strategy: Strategy,
    precision: Precision,
    data: DataBundle,
    start_step: int,
    nodes: list | None,
    on_exit: contextlib.ExitStack | None = None,
    *,
    accum: int,
    global_batch: int,
    n_params: int,
    flops_per_token: float,
    peak: float | None,
) -> Reporters:
    """The run's writer, inspector and profiler; what the run is, logged once (hparams,
    config, predicted memory, the one-line summary). The writer is closed on `on_exit`
    however the run ends: a run refused later has its run dir removed, and TensorBoard's
    writer thread must not be left writing into it."""
    # First: it refuses a setting this device cannot honour before anything is written.
    profiler = StepProfiler(cfg.profile, Path(cfg.run_dir), env)
    downstream = build_downstream(cfg, data.tokenizer)
    name = run_name(strategy.name, precision.name, env.world_size, cfg.model.name)
    writer = MetricsWriter(cfg.run_dir, env, cfg.metrics, start_step=start_step, run_name=name)
    if on_exit is not None:  # after a normal end's finish(), closing again does nothing
        on_exit.callback(writer.close)
    hparams = run_hparams(
        cfg,
        strategy=strategy.name,
        precision=precision.name,
        env=env,
        grad_accum_steps=accum,
        n_params=n_params,
        compile_enabled=strategy.compile_enabled,
    )
    cuda = env.device.type == "cuda"
    writer.start(hparams, asdict(cfg), cuda=cuda, mfu=peak is not None)
    if nodes is not None:
        log.info("ranks: %s", describe(nodes))
    if cuda:
        log.info("CUDA allocator: %s", env.allocator)
    inspector = Inspector(cfg.inspect, strategy, data.tokenizer, writer, env)
    if start_step == 0:
        writer.text("config", "```\n" + json.dumps(asdict(cfg), indent=1) + "\n```", 0)
    mem_plan = log_memory_prediction(cfg, precision, env, writer, start_step, hparams)
    speed = log_speed_prediction(cfg, env, writer, start_step, strategy.compile_enabled)
    log.info(
        "%s | %s | world %d | model %s: %.2fM params, %.3g FLOPs/token | global batch %d x %d "
        "tokens | run dir %s",
        strategy.name,
        precision.name,
        env.world_size,
        cfg.model.name,
        n_params / 1e6,
        flops_per_token,
        global_batch,
        cfg.trainer.seq_len,
        Path(cfg.run_dir),
    )
    warmup_warning = short_warmup_warning(cfg.optim, cfg.trainer.max_steps)
    if warmup_warning and env.is_main:  # a choice the user may mean (a smoke test): warn, run
        log.warning(warmup_warning)
    return Reporters(writer, inspector, profiler, downstream, mem_plan, speed)


def log_memory_prediction(
    cfg: TrainConfig, precision, env, writer: MetricsWriter, step: int, run_info: dict
) -> MemoryPlan | None:
    """Predicted memory per GPU, logged at the start (a text table `memory/predicted`;
    `run` and `memory_predicted` in metrics.jsonl). Returns the plan, which every logged step
    puts beside the measured memory (memory/predicted/*)."""
    try:
        plan, setup = run_prediction(cfg, precision, env)
    except ConfigError as e:  # a strategy the planner does not know yet: train anyway
        log.warning("memory: no prediction for this run: %s", e)
        return None
    lines = summary_lines(plan, setup, cfg.model)
    text = " ".join(lines)
    log.info("memory: %s", lines[0])  # the headline apart: the first line a user reads
    log.info("memory: %s", " ".join(lines[1:]))
    if step == 0:
        writer.text("memory/predicted", markdown_breakdown(plan, text), 0)
        writer.record({"step": 0, "run": run_info, "memory_predicted": predicted_record(plan)})
    return plan


def log_speed_prediction(
    cfg: TrainConfig, env: ddist.DistEnv, writer: MetricsWriter, step: int, compiled: bool
) -> SpeedPlan | None:
    """Predicted tokens/s per GPU (the speed plan, docs/planner.md), logged at the start and
    put beside the measured figure at every logged step; None off the known GPUs (CPU)."""
    try:
        speed = run_speed_prediction(cfg, env.world_size, env.device, compile_enabled=compiled)
    except ConfigError as e:  # a configuration the planner does not cover: train anyway
        log.warning("speed: no prediction for this run: %s", e)
        return None
    if speed is None:
        return None
    ms = {k: 1e3 * getattr(speed, f"{k}_s") for k in ("compute", "exposed_comm", "optimizer")}
    log.info(
        "speed: predicted %.0f tokens/s per GPU, %.0f ms per step (compute %.0f, exposed "
        "communication %.0f, optimizer %.0f ms; %s figures)",
        speed.tokens_per_s_per_gpu,
        1e3 * speed.step_s,
        ms["compute"],
        ms["exposed_comm"],
        ms["optimizer"],
        speed.machine,
    )
    if step == 0:
        writer.record({"step": 0, **predicted_speed_record(speed)})
    return speed
