"""Typed config schemas and their validation. The only module that touches OmegaConf.

`launch/train.py` composes the Hydra config and calls `from_dictconfig`; everything after that
sees plain dataclasses. Every check raises ConfigError with one line naming the key, the bad
value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dtrain.errors import ConfigError
from dtrain.model import ModelConfig
from dtrain.reliability.preemption import STOP_SIGNALS

# The choices of the config's string keys: validate() checks every Literal-typed field
# against its own (check_choices), so a choice is written once, in its type.
Device = Literal["auto", "cpu", "cuda"]
AttentionKernel = Literal["auto", "cudnn", "flash", "efficient", "math"]  # auto: torch's pick
ActivationCheckpointingMode = Literal["none", "full", "selective"]
CompileScope = Literal["model", "blocks"]
Fp8Recipe = Literal["tensorwise", "rowwise"]
# Which fp8 GEMMs accumulate fast (unpromoted): the forward one always (torchao's recipe), the
# grad-input one too, or all three (the grad-weight one as well).
Fp8FastAccum = Literal["forward", "grad_input", "all"]
Fp8Scaling = Literal["auto", "dynamic", "delayed"]
# precision=fp8 delayed scaling's first step where the model compiles: eager, or compiled too
Fp8FirstStep = Literal["eager", "compiled"]
# precision=int8's kernel choices (docs/precision.md, "int8"); each list's first is the default
Int8Kernel = Literal["auto", "triton", "torch"]
Int8Gemm = Literal["tma", "pointer", "gluon", "fastest"]
Int8Quantize = Literal["gradients", "fused", "apart"]
Int8QuantizeTiles = Literal["tuned", "sweeps"]
Int8Swiglu = Literal["linears", "fused"]
Int8GroupedGemm = Literal["auto", "gluon", "triton"]
# When DeepCompile runs its ZeRO-3 passes (dtrain.strategies.deepspeed.DEEPCOMPILE_SCHEDULES)
DeepCompileSchedule = Literal["deepspeed", "once", "resident", "gather"]
OnError = Literal["stop", "continue"]
OnNonfinite = Literal["skip", "stop"]
# What a data source that reaches the end of its documents does: start another epoch, hand its
# share to the other sources of a mixture, or stop the run.
OnExhausted = Literal["repeat", "reweight", "stop"]
WandbMode = Literal["offline", "online", "disabled"]
# The downstream tasks (dtrain/evaluation/tasks.py builds each one's items)
DownstreamTask = Literal["stdlib_cloze", "brackets"]


@dataclass
class MixtureSourceConfig:
    """One source of a data mixture: its name (TensorBoard's eval/<name>/loss), its weight (its
    share of the training blocks, normalised over the mixture) and where its documents are."""

    name: str = ""
    weight: float = 1.0
    source: str = "embedded"  # embedded | hub | local
    path: str | None = None
    subset: str | None = None
    split: str = "train"
    eval_split: str | None = None
    text_field: str = "text"
    files: Any = None
    format: str | None = None
    eval_fraction: float = 0.02
    max_bytes: int | None = None


@dataclass
class DataConfig:
    name: str = "embedded"  # the conf/data choice
    source: str = "embedded"  # embedded | hub | local | synthetic
    # hub: the dataset (path), its config (subset: load_dataset's `name`) and split; eval_split:
    # a held-out split (null: hold out eval_fraction of the documents instead).
    path: str | None = None
    subset: str | None = None
    split: str = "train"
    eval_split: str | None = None
    text_field: str = "text"  # the records' field holding the document
    files: Any = None  # local: a path, glob or directory, or a list of them
    format: str | None = None  # local: text | json | parquet (null: from the extension)
    tokenizer: str = "byte"  # byte | bpe | a tokenizer.json file/folder | a hub tokenizer name
    vocab_size: int | None = None  # synthetic: its random tokens' vocab; bpe: vocab (None: 8192)
    eval_fraction: float = 0.02  # share of documents held out for eval, never trained on
    max_bytes: int | None = None  # cap on the embedded corpus size (None: all of it)
    # streams the data is cut into; any world size reads them, a multiple of it reads each once
    num_streams: int = 8
    num_workers: int = 1  # DataLoader worker processes per rank (tokenize off the main process)
    prefetch_factor: int = 4  # items each worker keeps ready
    shuffle_window: int = 1024  # records shuffled together (per stream, reshuffled per epoch)
    bpe_train_bytes: int = 100_000_000  # text read to train data.tokenizer=bpe
    cache_dir: str | None = None  # trained tokenizers (null: $DTRAIN_CACHE or ~/.cache/dtrain)
    # Hugging Face datasets/tokenizers may ship Python code; it runs only if the user opts in.
    trust_remote_code: bool = False
    # Several sources drawn by weight (empty: the one source above); they share the tokenizer
    # and the stream settings above. docs/your-data.md, "Mixtures".
    mixture: list[MixtureSourceConfig] = field(default_factory=list)
    on_exhausted: OnExhausted = "repeat"
    # realised share of a mixture source further than this from its weight: a warning
    share_tolerance: float = 0.01


# trainer.micro_batch_size and strategy.reshard_after_forward: resolved by the memory plan
# before the run is built (dtrain.memory.search).
AUTO = "auto"
# What the keys that take AUTO accept, said whole when a value is none of it (a type name such
# as "true/false or a string" would not name auto).
AUTO_CHOICES = {
    "strategy.reshard_after_forward": f"true, false or {AUTO}",
    "trainer.micro_batch_size": f"a positive integer or {AUTO}",
}

# DDP's default bucket size, not torch's 25 MB: Dynamo splits the compiled graph at every bucket
# boundary, and small buckets ran slower and held more memory (docs/benchmarks.md).
DDP_BUCKET_MB = 400


@dataclass
class StrategyConfig:
    name: str = "single"
    compile: bool | None = None  # None: compile on CUDA, eager on CPU
    # single/ddp: what compile covers, `model` (one graph) or `blocks` (each block + the loss);
    # None: the strategy's default (single and ddp: model). fsdp/deepspeed: blocks always.
    compile_scope: CompileScope | None = None
    # DDP's gradient buckets (DeepSpeed's presets set their own, 2000); see DDP_BUCKET_MB.
    bucket_cap_mb: int = DDP_BUCKET_MB
    # fsdp: free each block's gathered parameters after its forward (true, ZeRO-3-like); false
    # keeps them until the backward (ZeRO-2-like: more memory, one all-gather less per step);
    # auto: false where the memory plan fits it with trainer.micro_batch_size=auto's margin
    # (dtrain.memory.search.resolve_auto_reshard), else true. false ran 1.02-1.10x faster on
    # 2x H200 (1b and 8b, bf16 and fp8; docs/benchmarks.md).
    reshard_after_forward: bool | str = AUTO
    cpu_offload: bool = False  # fsdp: parameters, gradients and optimizer step on the CPU
    activation_checkpointing: ActivationCheckpointingMode = "none"  # fsdp: per block
    replicate_degree: int = 1  # fsdp: > 1 is HSDP (replicate across groups, shard within)
    # fsdp on CUDA: gradients take the memory the backward frees on the compute stream, not a
    # pool of the reduce-scatter stream's own (8b, 2x H200: 14.80 GiB less reserved)
    grads_on_compute_stream: bool = True
    stage: int | None = None  # deepspeed: ZeRO stage 1, 2 or 3 (zero1/2/3 set it)
    offload_optimizer: bool = False  # deepspeed: optimizer states and step on the CPU
    offload_params: bool = False  # deepspeed (stage 3): parameters on the CPU
    # deepspeed (stage 1/3, CUDA): DeepSpeed's DeepCompile passes; None: on for ZeRO-3 on CUDA
    deepcompile: bool | None = None
    # DeepCompile under ZeRO-3: which passes at which step (deepspeed: DeepSpeed's own, the
    # model compiled twice, at steps 0 and 5; the others compile once, at step 0)
    deepcompile_schedule: DeepCompileSchedule = "deepspeed"


@dataclass
class ParallelConfig:
    """Dimensions of the device mesh besides data parallelism (dtrain/parallel/): each rank
    group of tp x cp ranks trains one data-parallel replica's batch. 1: off."""

    # Tensor parallelism with sequence parallelism: the attention heads, the feed-forward's
    # hidden units and the output layer's vocabulary split over tp ranks; norms over sequence.
    tp: int = 1
    # Context parallelism: each sequence split over cp ranks (load-balanced causal chunks),
    # attention gathering the keys and values of the others.
    cp: int = 1
    # Under tp: the loss over the output layer's vocabulary shards (torch's loss_parallel), no
    # rank holding all the logits; false gathers them whole on every tp rank.
    loss_parallel: bool = True


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    tf32: bool = False  # allow TF32 matmuls on GPUs for fp32
    optimizer_8bit: bool = False  # AdamW moments in 8 bits (torchao AdamW8bit)
    fp8_recipe: Fp8Recipe = "tensorwise"  # precision=fp8: per-tensor or per-row scales
    fp8_emulate: bool = False  # precision=fp8 without fp8 hardware (CPU tests): emulated, slow
    # precision=fp8 (tensorwise) under fsdp/hsdp: all-gather the linears' weights in fp8
    # (null: yes), or (false) in the compute dtype, each block casting them after the gather
    # (torchtitan's default).
    fp8_all_gather: bool | None = None
    # precision=fp8: the LM head's matmuls in fp8 too (its weight is the tied embedding's);
    # strategies that do not shard weights only (single, ddp)
    fp8_lm_head: bool = False
    # precision=fp8: which GEMMs accumulate in fp8's fast (unpromoted) mode: the forward one
    # (torchao's recipe: the backward ones promote to fp32), grad_input too (the default: at
    # bf16's loss, +1.5% speed at 1b; docs/precision.md), or all
    fp8_fast_accum: Fp8FastAccum = "grad_input"
    # precision=fp8 (tensorwise): the inputs' and output gradients' scales from this tensor's
    # amax (dynamic: two passes over it) or from the last fp8_amax_history steps' (delayed:
    # the cast fuses into the kernel that makes the tensor; dtrain/lowp/fp8/delayed.py); auto:
    # delayed where parameters are whole (single, ddp), dynamic where they are sharded
    # (dtrain.precision.resolve_fp8_scaling says why)
    fp8_scaling: Fp8Scaling = "auto"
    fp8_amax_history: int = 16
    # precision=fp8, delayed scaling under compile: the dynamic first step eager (its graphs
    # never compiled) or compiled like every later step (dtrain/lowp/fp8/delayed.py)
    fp8_first_step: Fp8FirstStep = "eager"
    # precision=int8: grad_weight matmul in int8 | int8_grouped | bf16 (SwitchBack); None: default
    int8_grad_weight: str | None = None
    # precision=int8's kernels: auto (Triton on Hopper, else torch._int_mm) or forced
    int8_kernel: Int8Kernel = "auto"
    # the Triton GEMM on large problems: the persistent TMA kernel, the pointer-load one, the
    # warp-specialized Gluon one (Hopper, Triton 3.6+), or per shape the faster of Gluon and TMA
    int8_gemm: Int8Gemm = "tma"
    # where each quantize runs under compile: only the output gradients' as the Triton op
    # (gradients), all fused into their producers by Inductor (fused), or all as the op (apart)
    int8_quantize: Int8Quantize = "gradients"
    # the row-wise quantize op's tile: autotuned per shape (tuned) or two fixed sweeps (sweeps)
    int8_quantize_tiles: Int8QuantizeTiles = "tuned"
    # each block's SwiGLU as three int8 linears or one function with fused quantizes
    int8_swiglu: Int8Swiglu = "linears"
    # int8_grad_weight=int8_grouped's GEMM on Hopper: Gluon where this Triton has it (auto)
    int8_grouped_gemm: Int8GroupedGemm = "auto"
    # Gradient reduction (DDP all-reduce, FSDP reduce-scatter, DeepSpeed) in fp32 | bf16;
    # None: the precision's own (fp32 master gradients are reduced in fp32).
    reduce_dtype: str | None = None


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    fused: bool | None = None  # None: fused on CUDA, foreach elsewhere


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0: only at the end / on a signal
    keep_last: int = 3  # 0: keep all
    save_final: bool = True
    # A save that fails (disk full, unwritable dir): stop the run, or warn and keep training
    # (the previous complete checkpoint stays the resume point).
    on_error: OnError = "stop"
    verify: bool = True  # check every file's sha256 against the manifest before loading
    # resume=PATH into a run dir holding later checkpoints: false refuses to start (they
    # would be overwritten or pruned); true deletes them once the resume point is loaded.
    overwrite_newer: bool = False
    # Periodic saves written in the background (torch.distributed.checkpoint.async_save): the
    # loop waits only for the copy of the state to host memory (pinned buffers kept for the
    # run). null: on with CUDA, off on CPU; on CUDA (true too) only where those buffers fit in
    # the node's memory and can be pinned, else synchronous with one warning (at 8b under fsdp
    # on 2x H200 a save stalled the loop 19.8 s, 18.7 of them making the buffers once, against
    # 169 s synchronous; docs/benchmarks.md).
    async_save: bool | None = None


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # the length of the LR schedule
    stop_at_step: int | None = None  # stop early (after saving) as a preemption would
    # Sequences per rank per forward/backward; "auto": the largest the memory plan says fits,
    # with a margin (dtrain.memory.resolve_auto_micro_batch, docs/planner.md).
    micro_batch_size: int | str = 16
    grad_accum_steps: int = 1
    # Sequences per optimizer step over all ranks. None: micro_batch_size * grad_accum_steps *
    # world size. Set, it fixes grad_accum_steps so that any world size trains the same batch.
    global_batch_size: int | None = None
    seq_len: int = 256
    eval_every: int = 100  # 0: no periodic eval
    eval_steps: int = 10
    log_every: int = 10
    grad_clip: float = 1.0  # 0: no clipping (the norm is still logged)
    progress_bar: bool = True
    device: Device = "auto"
    # The kernel scaled_dot_product_attention tries first (dtrain.attention).
    attention_kernel: AttentionKernel = "auto"
    # CUDA caching allocator with expandable segments (dtrain.dist.allocator_settings), unless
    # the user set PYTORCH_[CUDA_]ALLOC_CONF: less memory held by fragmentation, same speed.
    expandable_segments: bool = True
    # Bit-for-bit repeatable on CUDA when compiled too (dtrain.determinism): deterministic
    # kernels where torch has them; slower. Eager runs are repeatable without it.
    deterministic: bool = False
    # A non-finite gradient norm (NaN/inf loss or grads): skip that update (weights and
    # optimizer state untouched, counted as train/nonfinite_skipped), or save and stop.
    on_nonfinite: OnNonfinite = "stop"
    # Signals that mean "save a checkpoint and exit 0" (preemption; Slurm's --signal=USR1@90).
    stop_signals: list[str] = field(default_factory=lambda: list(STOP_SIGNALS))
    # A collective that waits longer than this names the missing rank and stops the run.
    collective_timeout_s: float = 600.0
    # Python's garbage collector (dtrain/run/gc_schedule.py): automatic collection off in the
    # loop and the young generations collected every gc_every steps, on every rank at the same
    # step; 0: Python's automatic collection. Either way perf/gc_pct logs the time it takes.
    gc_every: int = 50


@dataclass
class DebugConfig:
    """Fault injection for tests; every default is off."""

    inject_nonfinite_at_step: int | None = None  # make the loss NaN at this (1-based) step
    inject_nonfinite_rank: int | None = None  # only on this rank (None: every rank)


@dataclass
class WandbConfig:
    """Weights & Biases (pip install 'dtrain[wandb]'): the same scalars, the config as the
    run's config, the final summary. Offline by default: files under `dir`, `wandb sync` later."""

    enabled: bool = False
    project: str = "dtrain"
    entity: str | None = None
    name: str | None = None  # None: the run's configuration name (strategy-precision-wN-model)
    mode: WandbMode = "offline"
    dir: str | None = None  # None: the run dir (its wandb/ folder)
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    """MLflow (pip install 'dtrain[mlflow]'): scalars as metrics, the config as params, the
    final summary as metrics and summary.json."""

    enabled: bool = False
    # None: $MLFLOW_TRACKING_URI, else a file store in the run dir (<run_dir>/mlruns).
    tracking_uri: str | None = None
    experiment: str = "dtrain"
    run_name: str | None = None  # None: the run's configuration name


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    jsonl: bool = True
    # Peak FLOP/s of one device for MFU. None: a table for known GPUs; elsewhere (CPU, an
    # unknown GPU) MFU is not reported, since there is no real peak to divide by.
    peak_tflops: float | None = None
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class InspectConfig:
    """What each eval shows of the model's inside (dtrain/reporting/inspector.py); rank 0 writes
    it."""

    samples: bool = True  # sample text from `prompts`, logged as TensorBoard text
    prompts: list[str] = field(default_factory=lambda: ["def ", "import ", "class "])
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = 0.95
    seed: int = 0  # the same draws at every eval, so the text changes only with the model
    attention_maps: bool = True  # attention weights per layer and head as TensorBoard images
    attention_prompt: str = "def forward(self, x):\n    return self.proj(x) + x\n"
    attention_max_tokens: int = 48  # prompt tokens shown (the map is that many squared)
    attention_layers: list[int] | None = None  # None: every layer
    attention_scale: int = 4  # pixels per attention entry


@dataclass
class ProfileConfig:
    """torch.profiler over training steps: wait, warmup, then record `active` steps, `repeat`
    times (0: until the end). Traces go to <run_dir>/tensorboard/profile/ (all ranks)."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    row_limit: int = 20  # rows of the top-operators table printed at the end
    # CUDA: record the caching allocator over the first N steps, then write its snapshot and
    # where reserved memory sits, per stream (dtrain.reporting.allocator_snapshot). 0: off.
    memory_snapshot_steps: int = 0


@dataclass
class DownstreamConfig:
    """Multiple-choice tasks scored by the log-likelihood of each choice (dtrain/evaluation/),
    logged as eval/downstream/<task>/acc and acc_norm; their items need no download."""

    every: int = 0  # steps between scorings, a multiple of trainer.eval_every; 0: off
    tasks: list[str] = field(default_factory=lambda: list(typing.get_args(DownstreamTask)))
    items: int = 200  # items per task
    seed: int = 0  # which items: the same seed, the same items in every run


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    inspect: InspectConfig = field(default_factory=InspectConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    seed: int = 1337
    resume: str = "auto"  # auto | never | <path to a checkpoint folder>
    run_dir: str = "outputs/run"


# --- dict -> dataclass, with messages a person can act on ---------------------------------


def yaml_value(value) -> str:
    """A value as it is written on the command line (true, null), not as Python prints it."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (list, tuple):
        return "a list"
    if typing.get_origin(tp) is Literal:
        return _type_name(type(typing.get_args(tp)[0]))
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:  # an optional key names null too: it is one of the valid choices
        names = [_type_name(a) for a in args] + (
            ["null"] if len(args) < len(typing.get_args(tp)) else []
        )
        return " or ".join(names)
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        must = AUTO_CHOICES.get(key) or _type_name(tp)
        raise ConfigError(f"{key} must be {must}, got {yaml_value(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is Any:
        return value
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return build_dataclass(tp, value, f"{key}.")
    elif origin is Literal:  # its choices are checked with the others (check_choices)
        try:
            return _coerce(value, type(typing.get_args(tp)[0]), key)
        except ConfigError:  # a value of another type (true for a string): name the choices
            choices = say_choices(typing.get_args(tp))
            raise ConfigError(f"{key}={yaml_value(value)} is not valid; choose {choices}") from None
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            (inner,) = typing.get_args(tp)[:1] or (Any,)
            return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {yaml_value(value)}")


def build_dataclass(cls: type, data: dict | None, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys and wrong types."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}'; valid keys under {where}: "
            + ", ".join(sorted(fields))
        )
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name} must be a group of keys, got {value!r}")
            kwargs[name] = build_dataclass(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    return cls(**kwargs)


def from_dict(data: dict) -> TrainConfig:
    cfg = build_dataclass(TrainConfig, data)
    validate(cfg)
    return cfg


def from_dictconfig(dcfg: Any) -> TrainConfig:
    """Hydra's DictConfig -> TrainConfig (resolving interpolations; dropping the hydra node)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    data = {}
    try:
        for key in dcfg:
            if key == "hydra":  # Hydra's own node: not ours, and partly unresolvable here
                continue
            value = dcfg[key]
            data[key] = (
                OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
            )
    except OmegaConfBaseException as e:
        raise ConfigError(f"config could not be resolved: {str(e).splitlines()[0]}") from None
    return from_dict(data)


# --- validation --------------------------------------------------------------------------

RESUME_CHOICES = ("auto", "never")
ACTIVATION_CHECKPOINTING = typing.get_args(ActivationCheckpointingMode)

# The valid range of every number in the schema, in one place. validate() checks each value
# set (None means "unset" and passes) and refuses any non-finite float: NaN fails every
# comparison, and inf passes "> 0", so a range alone would not stop either.
RANGES: dict[str, str] = {
    "model.n_layer": "> 0",
    "model.n_head": "> 0",
    "model.n_kv_head": "> 0",
    "model.d_model": "> 0",
    "model.ffn_hidden": "> 0",
    "model.vocab_size": "> 0",
    "model.max_seq_len": "> 0",
    "model.rope_theta": "> 0",
    "model.norm_eps": "> 0",
    "model.init_std": "> 0",
    "data.eval_fraction": "(0, 1)",
    "data.max_bytes": "> 0",
    "data.share_tolerance": "(0, 1)",
    "strategy.bucket_cap_mb": "> 0",
    "precision.fp8_amax_history": "> 0",
    "strategy.replicate_degree": "> 0",
    "parallel.tp": "> 0",
    "parallel.cp": "> 0",
    "optim.lr": "> 0",
    "optim.min_lr_ratio": "[0, 1]",
    "optim.warmup_steps": ">= 0",
    "optim.weight_decay": ">= 0",
    "optim.beta1": "[0, 1)",
    "optim.beta2": "[0, 1)",
    "optim.eps": "> 0",
    "checkpoint.every_n_steps": ">= 0",
    "checkpoint.keep_last": ">= 0",
    "trainer.max_steps": "> 0",
    "trainer.stop_at_step": "> 0",
    "trainer.micro_batch_size": "> 0",
    "trainer.grad_accum_steps": "> 0",
    "trainer.global_batch_size": "> 0",
    "trainer.seq_len": "> 0",
    "trainer.eval_every": ">= 0",
    "trainer.eval_steps": ">= 0",
    "trainer.log_every": "> 0",
    "trainer.grad_clip": ">= 0",
    "trainer.collective_timeout_s": "> 0",
    "trainer.gc_every": ">= 0",
    "metrics.peak_tflops": "> 0",
    "inspect.max_new_tokens": ">= 0",
    "inspect.temperature": ">= 0",
    "inspect.top_k": ">= 0",
    "inspect.top_p": "(0, 1]",
    "inspect.attention_max_tokens": "> 0",
    "inspect.attention_scale": "> 0",
    "profile.wait": ">= 0",
    "profile.warmup": ">= 0",
    "profile.active": "> 0",
    "profile.repeat": ">= 0",
    "profile.row_limit": "> 0",
    "profile.memory_snapshot_steps": ">= 0",
    "downstream.every": ">= 0",
    "downstream.items": "[1, 100000]",
    "downstream.seed": ">= 0",
    "debug.inject_nonfinite_at_step": "> 0",
    "debug.inject_nonfinite_rank": ">= 0",
}


# AdamW's step is about lr per weight whatever the gradient: past this, weights of order 1
# are replaced by noise on the first update.
MAX_LR = 10.0


def in_range(value: int | float, spec: str) -> bool:
    """`spec` is "> a", ">= a", or an interval such as "[0, 1)"; NaN is in no range."""
    if spec.startswith(">="):
        return value >= float(spec[2:])
    if spec.startswith(">"):
        return value > float(spec[1:])
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    above = value >= lo if spec[0] == "[" else value > lo
    below = value <= hi if spec[-1] == "]" else value < hi
    return above and below


def _leaves(node: Any, prefix: str = ""):
    """(dotted key, value) of every scalar field of a config dataclass, in schema order."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def choices_of(tp: Any) -> tuple | None:
    """The values a Literal-typed field may hold (None among them if it is optional)."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and typing.get_origin(inner[0]) is Literal:
            return (*typing.get_args(inner[0]), None)
    return None


def say_choices(choices: tuple) -> str:
    """Two choices read "a or b"; longer lists are comma-separated, as the registries' are."""
    names = ["null" if c is None else str(c) for c in choices]
    return " or ".join(names) if len(names) == 2 else ", ".join(names)


def check_choices(cfg: Any, prefix: str = "") -> None:
    """Every Literal-typed field of `cfg` holds one of its choices: one line naming the key,
    the value and the choices."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{key}.")
            continue
        choices = choices_of(hints[f.name])
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}={value!r} is not valid; choose {say_choices(choices)}")


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Every number of `cfg` finite and within RANGES: one line naming key, value and range."""
    for key, value in _leaves(cfg, prefix):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        spec = RANGES.get(key)
        finite = math.isfinite(value)
        if finite and (spec is None or in_range(value, spec)):
            continue
        need = "" if spec is None else spec if spec.startswith(">") else f"in {spec}"
        if not finite:
            need = f"a finite number {need}".rstrip()
        raise ConfigError(f"{key} must be {need}, got {value}")


def validate(cfg: TrainConfig) -> None:
    """Checks that need no other module. Strategy/precision/data names are checked by their
    registries when built (they know their own choices)."""
    t, m = cfg.trainer, cfg.model
    check_ranges(cfg)
    _check_auto(cfg)
    check_choices(cfg)
    if t.stop_at_step is not None and t.stop_at_step > t.max_steps:
        raise ConfigError(
            f"trainer.stop_at_step={t.stop_at_step} is past trainer.max_steps={t.max_steps}"
        )
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by n_head={m.n_head}")
    if m.head_dim % 2 and m.rope:
        raise ConfigError(f"model head dim {m.head_dim} must be even for RoPE")
    if m.n_head % m.n_kv_head:
        raise ConfigError(f"model.n_head={m.n_head} must be divisible by n_kv_head={m.n_kv_head}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if cfg.optim.lr > MAX_LR:
        raise ConfigError(
            f"optim.lr={cfg.optim.lr:g} is past any rate AdamW trains at (the first update "
            f"overflows); choose optim.lr in (0, {MAX_LR:g}], e.g. 3e-4"
        )
    validate_inspect(cfg.inspect, cfg.profile, m)
    validate_loggers(cfg.metrics)
    _validate_strategy(cfg.strategy)
    validate_reliability(cfg)
    validate_mixture(cfg.data)
    validate_downstream(cfg.downstream, t.eval_every, cfg.data.source, cfg.parallel)
    if cfg.resume not in RESUME_CHOICES and not Path(cfg.resume).exists():
        raise ConfigError(
            f"resume={cfg.resume!r}: no such checkpoint folder; "
            "choose auto, never, or the path of a checkpoints/step_NNNNNNN folder"
        )


# A mixture source's name is a TensorBoard tag part (eval/<name>/loss) and a file-safe key.
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# eval/<source>/... sits beside these tags of the eval itself
RESERVED_SOURCE_NAMES = ("downstream", "loss", "ppl", "seconds")


def validate_mixture(d: DataConfig) -> None:
    """data.mixture: named, weighted sources, names unique and safe as tags, weights positive."""
    seen: set[str] = set()
    for i, src in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        if not SOURCE_NAME.fullmatch(src.name):
            raise ConfigError(
                f"{key}.name={src.name!r} is not valid; give each source a name of letters, "
                "digits, '_', '-' or '.' (up to 64, starting with a letter or digit)"
            )
        if src.name in RESERVED_SOURCE_NAMES:
            raise ConfigError(
                f"{key}.name={src.name!r} is taken by the eval's own tags; choose a name other "
                f"than {', '.join(RESERVED_SOURCE_NAMES)}"
            )
        if src.name in seen:
            raise ConfigError(f"{key}.name={src.name!r} is used twice; source names must differ")
        seen.add(src.name)
        if not (math.isfinite(src.weight) and src.weight > 0):
            raise ConfigError(f"{key}.weight must be a finite number > 0, got {src.weight}")
        if src.source not in ("embedded", "hub", "local"):
            raise ConfigError(
                f"{key}.source={src.source!r} is not valid; choose embedded, hub or local"
            )
        if not 0 < src.eval_fraction < 1:
            raise ConfigError(f"{key}.eval_fraction must be in (0, 1), got {src.eval_fraction}")
    if d.mixture and d.source == "synthetic":
        raise ConfigError("data.mixture cannot be used with data=synthetic; choose another data")


def validate_inspect(i: InspectConfig, p: ProfileConfig, m: ModelConfig) -> None:
    """What the number ranges (RANGES) cannot say about inspect and profile."""
    for layer in i.attention_layers or []:
        if not 0 <= layer < m.n_layer:
            raise ConfigError(
                f"inspect.attention_layers has {layer}; the model has layers 0..{m.n_layer - 1}"
            )
    if m.init_from is not None:
        from dtrain.hf import parse_init_from

        parse_init_from(m.init_from)


def validate_downstream(
    d: DownstreamConfig, eval_every: int, source: str, parallel: ParallelConfig
) -> None:
    """Known task names, text to score them with, a schedule that falls on eval steps (scores
    are taken after the eval loss), and a model whole on each rank's sequence (the scorer
    spreads its items over all ranks)."""
    valid = typing.get_args(DownstreamTask)
    for task in d.tasks:
        if task not in valid:
            raise ConfigError(f"downstream.tasks has {task!r}; valid tasks: {say_choices(valid)}")
    if d.every and not d.tasks:
        raise ConfigError("downstream.every is set but downstream.tasks is empty; name a task")
    if d.every and source == "synthetic":
        raise ConfigError(
            "downstream.every is set but data.source=synthetic has no tokenizer to read the "
            "tasks' text; train on text data (e.g. data=embedded) or set downstream.every=0"
        )
    if d.every and (parallel.tp > 1 or parallel.cp > 1):
        raise ConfigError(
            f"downstream.every={d.every} is not available with parallel.tp={parallel.tp}, "
            f"parallel.cp={parallel.cp}; set downstream.every=0 or parallel.tp=1 parallel.cp=1"
        )
    if d.every and (eval_every == 0 or d.every % eval_every):
        raise ConfigError(
            f"downstream.every={d.every} must be a multiple of trainer.eval_every={eval_every} "
            "(downstream scores are taken at eval steps), or 0 for off"
        )


def validate_loggers(mc: MetricsConfig) -> None:
    """A logger that is on must have its library installed (checked without importing it,
    on every rank, before anything is written)."""
    import importlib.util

    for key, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if getattr(mc, key).enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"metrics.{key}.enabled=true needs the {module} package: "
                f"pip install 'dtrain[{key}]' (or metrics.{key}.enabled=false)"
            )


def _check_auto(cfg: TrainConfig) -> None:
    """A string in a key that takes AUTO must be AUTO (the types allow any string)."""
    for key in AUTO_CHOICES:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str) and value != AUTO:
            raise ConfigError(f"{key} must be {AUTO_CHOICES[key]}, got {yaml_value(value)}")


def _validate_strategy(s: StrategyConfig) -> None:
    """What ranges and choices cannot say; which strategy honours which option is checked by
    the strategy."""
    if s.stage is not None and s.stage not in (1, 2, 3):
        raise ConfigError(f"strategy.stage={s.stage} is not a ZeRO stage; choose 1, 2 or 3")


def validate_reliability(cfg: TrainConfig) -> None:
    """trainer.stop_signals: names of signals this process can catch."""
    import signal

    t = cfg.trainer
    valid = sorted(s.name for s in signal.Signals if s.name not in ("SIGKILL", "SIGSTOP"))
    for name in t.stop_signals:
        if name not in valid:
            raise ConfigError(
                f"trainer.stop_signals: {name!r} is not a signal this process can catch; "
                f"valid names: {', '.join(valid)}"
            )


def resolve_grad_accum(t: TrainerConfig, world_size: int) -> int:
    """Micro-steps per optimizer step, from global_batch_size when it is set."""
    if t.global_batch_size is None:
        return t.grad_accum_steps
    if t.micro_batch_size == AUTO:  # a bug, not a user's error: resolve it first
        raise ValueError("resolve trainer.micro_batch_size=auto before the accumulation")
    per_pass = t.micro_batch_size * world_size
    if t.global_batch_size % per_pass:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} cannot be served by "
            f"micro_batch_size={t.micro_batch_size} x {world_size} ranks; "
            f"choose a multiple of {per_pass}"
        )
    return t.global_batch_size // per_pass


# --- Hydra composition (for launch/train.py and the CLIs) ----------------------------------

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "data", "strategy", "precision", "optim", "checkpoint")


def group_choices(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def _explain_hydra_error(e: Exception, overrides: list[str]) -> str:
    """Hydra's multi-line composition errors -> one line with the valid choices."""
    text = str(e)
    m = re.search(r"Could not find '([\w-]+)/([^']*)'", text)
    if m and m.group(1) in GROUPS:
        group, name = m.groups()
        return f"unknown {group} '{name}'; valid choices: {', '.join(group_choices(group))}"
    m = re.search(r"Could not override '([^']+)'", text) or re.search(
        r"Key '([^']+)' is not in struct", text
    )
    if m:
        key = m.group(1)
        return f"unknown config key '{key}'; see the valid keys with: launch/train.py --cfg job"
    m = re.search(r"Could not load '([\w-]+)/([^']*)'", text)
    if m:
        return f"{m.group(1)} config '{m.group(2)}' could not be loaded: {text.splitlines()[-1]}"
    first = next((line for line in text.splitlines() if line.strip()), type(e).__name__)
    return f"bad command line ({' '.join(overrides)}): {first.strip()}"


# Keys only some precisions' files have (a key a precision's file lacks is an unknown key).
PRECISION_OWN_KEYS = (
    "fp8_recipe",
    "fp8_emulate",
    "fp8_all_gather",
    "fp8_lm_head",
    "fp8_fast_accum",
    "fp8_scaling",
    "fp8_amax_history",
    "fp8_first_step",
    "int8_grad_weight",
    "int8_kernel",
    "int8_gemm",
    "int8_quantize",
    "int8_quantize_tiles",
    "int8_swiglu",
    "int8_grouped_gemm",
)


def schema_defaults(cls: type) -> dict:
    """A config dataclass's fields at their declared defaults, before __post_init__ derives
    any (ModelConfig's n_kv_head and ffn_hidden stay null, to follow n_head and d_model)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = schema_defaults(hints[f.name])
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()
    return out


def register_config_bases() -> None:
    """The bases that conf/ files extend: `<group>_base` for each group's files and
    `train_base` for train.yaml's own sections, each the schema's defaults; so every default
    is written once, here, and a file lists only what differs."""
    from hydra.core.config_store import ConfigStore

    train = schema_defaults(TrainConfig)
    del train["run_dir"]  # Hydra's output dir: train.yaml sets it
    for key in PRECISION_OWN_KEYS:
        del train["precision"][key]
    for group in GROUPS:
        ConfigStore.instance().store(name=f"{group}_base", node=train.pop(group))
    ConfigStore.instance().store(name="train_base", node=train)


def compose(overrides: list[str], conf_dir: Path = CONF_DIR) -> TrainConfig:
    """Compose conf/train.yaml with Hydra overrides into a validated TrainConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    register_config_bases()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            dcfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
    except Exception as e:  # Hydra's exceptions have no common base worth naming
        raise ConfigError(_explain_hydra_error(e, overrides)) from None
    HydraConfig.instance().set_config(dcfg)
    try:
        run_dir = OmegaConf.select(dcfg, "hydra.run.dir")
    except Exception as e:
        raise ConfigError(f"hydra.run.dir could not be resolved: {e}") from None
    with open_dict(dcfg):
        dcfg.run_dir = run_dir
    return from_dictconfig(dcfg)
