"""The planner's input: what decides memory per GPU besides the model, read from a TrainConfig
and checked. How a strategy holds memory is its own declaration (Strategy.memory_facts)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from dtrain.config import (
    ACTIVATION_CHECKPOINTING,
    DDP_BUCKET_MB,
    ParallelConfig,
    StrategyConfig,
    resolve_grad_accum,
)
from dtrain.errors import ConfigError
from dtrain.model import ModelConfig
from dtrain.strategies import STRATEGIES, MemoryFacts, check_parallel, strategy_class


@dataclass
class MemorySetup:
    """Everything besides the model config that decides memory per GPU."""

    strategy: str  # a name in the strategy registry (dtrain.strategies.STRATEGIES)
    precision: object  # dtrain.precision.Precision (duck-typed: its dtype fields are read)
    world_size: int = 1
    micro_batch_size: int = 1
    seq_len: int = 256
    activation_checkpointing: str = "none"
    compile: bool = False  # torch.compile (inductor) changes what backward keeps
    compile_scope: str | None = None  # single/ddp: model | blocks (None: the strategy's default)
    reshard_after_forward: bool = True  # fsdp
    replicate_degree: int = 1  # fsdp: HSDP replicas (shard within world_size / replicate_degree)
    tp: int = 1  # parallel.tp: tensor (and sequence) parallel ranks of one replica
    cp: int = 1  # parallel.cp: context parallel ranks of one replica
    loss_parallel: bool = True  # parallel.loss_parallel: under tp the logits stay split
    cpu_offload: bool = False  # fsdp: sharded params, grads, optimizer states live on the host
    # fsdp on CUDA: gradient shards from the compute stream's memory (False, or HSDP: a pool of
    # the reduce-scatter stream's own, reserved beside the compute stream's peak)
    grads_on_compute_stream: bool = True
    offload_optimizer: bool = False  # zero*: optimizer states (and fp32 master) on the host
    offload_params: bool = False  # zero3: parameters on the host
    ds_bucket_elements: int = 25 * 2**20 // 4  # DeepSpeed's reduce/allgather buckets
    ddp_bucket_mb: int = DDP_BUCKET_MB  # DDP's gradient buckets (strategy.bucket_cap_mb)
    device: str = "cuda"  # cpu: no context, no allocator slack
    rank: int = 0  # model state is planned for this rank (FSDP's last ranks may hold less)
    grad_accum_steps: int = 1  # micro-steps per optimizer step (ZeRO-1 then holds full grads)
    # DeepSpeed's zero_optimization.overlap_comm (reduce during backward). None: as dtrain's
    # generated config sets it, on CUDA only (DeepSpeedStrategy.ds_config).
    ds_overlap_comm: bool | None = None
    # zero3 compiled: DeepSpeed's DeepCompile (its own graph, no hooks), or torch.compile over
    # the engine's hooks (False). None: the strategy's default (DeepCompile), as for a
    # candidate the search or the OOM advice makes from another strategy's config.
    deepcompile: bool | None = None

    @property
    def facts(self) -> MemoryFacts:
        """How the strategy holds memory, as it declares it."""
        return strategy_facts(self.strategy)

    @property
    def data_world(self) -> int:
        """Data-parallel replicas: the ranks of one tp x cp group train one batch."""
        return self.world_size // (self.tp * self.cp)

    def honours(self, option: str) -> bool:
        """Whether the strategy honours a StrategyConfig option (one it ignores plans as unset)."""
        return option in STRATEGIES[self.strategy].options


_FIELDS = {f.name for f in fields(MemorySetup)}


def strategy_facts(name: str) -> MemoryFacts:
    cls = STRATEGIES.get(name)
    facts = cls.memory_facts(name) if cls is not None else None
    if facts is None:
        known = sorted(n for n, c in STRATEGIES.items() if c.memory_facts(n) is not None)
        raise ConfigError(f"cannot plan strategy '{name}'; valid choices: {', '.join(known)}")
    return facts


def setup_from_config(
    cfg, precision, world_size: int, device: str = "cuda", rank: int = 0
) -> MemorySetup:
    """A MemorySetup from a TrainConfig; the strategy says what its config means for memory
    (options the planner has no field for, such as compile_scope, change nothing in it)."""
    t, tp, cp = cfg.trainer, cfg.parallel.tp, cfg.parallel.cp
    options = strategy_class(cfg.strategy.name).memory_options(cfg.strategy, device)
    return MemorySetup(
        precision=precision,
        world_size=world_size,
        micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len,
        device=device,
        rank=rank,
        tp=tp,
        cp=cp,
        loss_parallel=cfg.parallel.loss_parallel,
        grad_accum_steps=resolve_grad_accum(t, max(1, world_size // (tp * cp))),
        **{key: value for key, value in options.items() if key in _FIELDS},
    )


def check_setup(cfg: ModelConfig, setup: MemorySetup) -> None:
    strategy_facts(setup.strategy)
    if setup.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(
            f"activation_checkpointing={setup.activation_checkpointing!r}; "
            f"valid choices: {', '.join(ACTIVATION_CHECKPOINTING)}"
        )
    if setup.world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {setup.world_size}")
    if setup.world_size != 1 and not STRATEGIES[setup.strategy].needs_distributed:
        raise ConfigError(
            f"strategy={setup.strategy} runs one process; use world_size=1 or strategy=ddp"
        )
    rd = max(1, setup.replicate_degree)
    if setup.world_size % rd:
        raise ConfigError(f"replicate_degree={rd} does not divide world_size={setup.world_size}")
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size is unknown: set model.vocab_size=N to plan")
    check_parallel(
        StrategyConfig(name=setup.strategy, replicate_degree=setup.replicate_degree),
        ParallelConfig(tp=setup.tp, cp=setup.cp),
        setup.precision,
        world_size=setup.world_size,
        model=cfg,
        seq_len=setup.seq_len,
    )


def resolve_vocab(cfg) -> int:
    """The model's vocab as the run would set it: model.vocab_size, else the tokenizer's."""
    from dtrain.data.tokenizer import BPE_DEFAULT_VOCAB, ByteTokenizer, padded_vocab

    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.source == "synthetic" and cfg.data.vocab_size:
        return padded_vocab(cfg.data.vocab_size)
    if cfg.data.tokenizer == "byte":
        return padded_vocab(ByteTokenizer().vocab_size)
    if cfg.data.tokenizer == "bpe":  # trained to exactly data.vocab_size tokens
        return padded_vocab(cfg.data.vocab_size or BPE_DEFAULT_VOCAB)
    raise ConfigError(
        f"cannot tell the vocab of tokenizer {cfg.data.tokenizer!r} without loading it; "
        "add model.vocab_size=N (e.g. 50304 for GPT-2's)"
    )


def plan_precision(cfg):
    """The run's Precision, built for the planned device rather than this machine's, so fp8
    and fp16 plan on a laptop too."""
    from dtrain.config import PrecisionConfig

    return precision_for(PrecisionConfig(**cfg.precision.__dict__), cfg.strategy.name)


def precision_for(pcfg, strategy: str):
    """The Precision a run of `strategy` builds from `pcfg` (precision.fp8_scaling=auto resolves
    by whether the strategy shards its parameters), checked for values only."""
    import torch

    from dtrain.precision import build_precision

    shards = strategy_class(strategy).shards_params(strategy)
    return build_precision(pcfg, torch.device("cpu"), check_device=False, shards_params=shards)


def planned_config(cfg, world_size: int, device: str = "cuda", rank: int = 0):
    """(cfg with its vocab resolved, its Precision, its MemorySetup): what the planner's entry
    points start from."""
    from dataclasses import replace

    cfg = replace(cfg, model=replace(cfg.model, vocab_size=resolve_vocab(cfg)))
    precision = plan_precision(cfg)
    return cfg, precision, setup_from_config(cfg, precision, world_size, device, rank)
