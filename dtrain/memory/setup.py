"""The planner's input: what decides memory per GPU besides the model, checked, or read from a
TrainConfig."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config import DDP_BUCKET_MB
from dtrain.model import ModelConfig

STRATEGY_NAMES = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3")
CHECKPOINTING = ("none", "full", "selective")


@dataclass
class MemorySetup:
    """Everything besides the model config that decides memory per GPU."""

    strategy: str
    precision: object  # dtrain.precision.Precision (duck-typed: its dtype fields are read)
    world_size: int = 1
    micro_batch_size: int = 1
    seq_len: int = 256
    activation_checkpointing: str = "none"
    compile: bool = False  # torch.compile (inductor) changes what backward keeps
    reshard_after_forward: bool = True  # fsdp
    replicate_degree: int = 1  # fsdp: HSDP replicas (shard within world_size / replicate_degree)
    cpu_offload: bool = False  # fsdp: sharded params, grads, optimizer states live on the host
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


def setup_from_config(
    cfg, precision, world_size: int, device: str = "cuda", rank: int = 0
) -> MemorySetup:
    """A MemorySetup from a TrainConfig. Strategy options are read by name with their
    defaults, so the planner works before and after a strategy adds them to StrategyConfig."""
    from dtrain.config import resolve_grad_accum

    st, t = cfg.strategy, cfg.trainer
    compile_ = getattr(st, "compile", None)
    compile_ = compile_ if compile_ is not None else device == "cuda"
    ckpt = getattr(st, "activation_checkpointing", "none")
    if isinstance(ckpt, bool):
        ckpt = "full" if ckpt else "none"
    name = st.name
    if name == "deepspeed":  # strategy=deepspeed strategy.stage=N is zeroN
        name = f"zero{getattr(st, 'stage', 2)}"
    if name == "hsdp":  # fsdp sharding within groups, replicated across them
        name = "fsdp"
    if name == "zero3" and st.compile is None and getattr(st, "deepcompile", None) is False:
        compile_ = False  # ZeRO-3 without DeepCompile runs its blocks eagerly
    return MemorySetup(
        strategy=name,
        precision=precision,
        world_size=world_size,
        micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len,
        activation_checkpointing=ckpt or "none",
        compile=bool(compile_),
        reshard_after_forward=bool(getattr(st, "reshard_after_forward", True)),
        replicate_degree=int(getattr(st, "replicate_degree", None) or 1),
        cpu_offload=bool(getattr(st, "cpu_offload", False)),
        offload_optimizer=bool(getattr(st, "offload_optimizer", False)),
        offload_params=bool(getattr(st, "offload_params", False)),
        # dtrain's DeepSpeed config sizes its buckets from bucket_cap_mb (elements of 4 bytes).
        ds_bucket_elements=int(getattr(st, "bucket_cap_mb", 25)) * 2**20 // 4,
        ddp_bucket_mb=int(getattr(st, "bucket_cap_mb", DDP_BUCKET_MB)),
        device=device,
        rank=rank,
        grad_accum_steps=resolve_grad_accum(t, world_size),
    )


def check_setup(cfg: ModelConfig, setup: MemorySetup) -> None:
    from dtrain.errors import ConfigError

    if setup.strategy not in STRATEGY_NAMES:
        raise ConfigError(
            f"cannot plan strategy '{setup.strategy}'; valid choices: {', '.join(STRATEGY_NAMES)}"
        )
    if setup.activation_checkpointing not in CHECKPOINTING:
        raise ConfigError(
            f"activation_checkpointing={setup.activation_checkpointing!r}; "
            f"valid choices: {', '.join(CHECKPOINTING)}"
        )
    if setup.world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {setup.world_size}")
    if setup.strategy == "single" and setup.world_size != 1:
        raise ConfigError("strategy=single runs one process; use world_size=1 or strategy=ddp")
    rd = max(1, setup.replicate_degree)
    if setup.world_size % rd:
        raise ConfigError(f"replicate_degree={rd} does not divide world_size={setup.world_size}")
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size is unknown: set model.vocab_size=N to plan")
