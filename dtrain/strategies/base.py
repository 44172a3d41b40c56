"""The Strategy interface: everything the loop needs from a way of training on one or many devices.

A strategy owns: building and wrapping the model, building the optimizer after wrapping,
forward/backward (no gradient sync on non-final micro-steps), clipping and stepping, the state it
saves and loads, and the bytes of model state its rank holds. It also declares the facts others
need about it (the names it answers to, the precisions it accepts, how it holds memory), so the
loop, the planner and the precision checks never ask its name.

The defaults here are the single-device behaviour; a strategy overrides what differs.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from dtrain.config import (
    AUTO,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    StrategyConfig,
    yaml_value,
)
from dtrain.dist import DistEnv
from dtrain.errors import ConfigError
from dtrain.model import build_model
from dtrain.optim import set_lr
from dtrain.precision import (
    PRECISIONS,
    Precision,
    apply_precision,
    build_loss_scaler,
    build_precision_optimizer,
    check_strategy,
    precision_hooks,
)
from dtrain.reliability.nonfinite import NonfiniteGuard
from dtrain.strategies.eager_step import eager_step

log = logging.getLogger("dtrain")


@dataclass(frozen=True)
class MemoryFacts:
    """How a strategy holds memory on each rank: what dtrain.memory plans from."""

    # Mixed precision by autocast over weights kept in the param dtype; False: the wrapper hands
    # the module its weights already in the compute dtype (FSDP's policy, DeepSpeed's cast).
    autocast: bool = True
    # The model state split over the ranks: any of "params", "grads", "optim" (ZeRO's stages).
    shards: frozenset[str] = frozenset()
    # How it is split: "dim0" (each tensor's rows, padded to the shard group: FSDP2), "flat"
    # (each tensor flattened and padded: ZeRO-3) or "groups" (each optimizer param group
    # flattened, padded to 2N: ZeRO-1/2); "" where nothing is split.
    partition: str = ""
    # The optimizer steps an fp32 master partition apart from the module, whose weights are
    # cast to the compute dtype (DeepSpeed's ZeRO optimizers, even in fp32).
    fp32_master: bool = False
    # Gradient buffers outlive the optimizer step (DDP's buckets, ZeRO-3's partitions); False:
    # zero_grad(set_to_none) frees the gradients.
    persistent_grads: bool = False
    # Dynamo cuts a compiled graph at its gradient buckets (DDP's DDPOptimizer).
    graph_split_buckets: bool = False


@dataclass(frozen=True)
class Collective:
    """One collective a strategy runs each step, as the speed planner prices it (ring
    algorithm: all-reduce moves 2(n-1)/n of the payload per rank, the others (n-1)/n)."""

    op: str  # all_reduce | all_gather | reduce_scatter
    # whose elements travel: "params" or "grads" (of the whole model), or a parallel dimension's
    # "activations" (tp: the residual stream) or "kv" (cp: keys and values)
    tensor: str
    dtype: str  # the Precision's dtype on the wire: "compute" or "reduce"
    # Which ranks take part: "world", "shard" (world / replicate_degree: HSDP's shard group;
    # world / tp beside tensor parallelism), "replicate" (replicate_degree ranks holding the
    # same shard), "tp" or "cp" (parallel.tp or parallel.cp ranks of one replica).
    group: str = "world"
    times: int = 1  # how often per micro-step (per_micro) or per optimizer step
    per_micro: bool = False  # on every micro-step (gathers), else once per optimizer step
    # "full": the model's tensors; "shard": one shard group's slice; "resharded": the blocks
    # the forward freed (all but the last; the root and the last block stay gathered)
    payload: str = "full"
    # latency: "blocks" (one call per block + the root), "resharded" (one per freed block),
    # "buckets" or "once"
    calls: str = "once"
    overlap: float = 0.0  # share of its time run under compute (the rest is exposed)
    window: str = "backward"  # the compute it can hide under: "backward" or "step" (fwd + bwd)
    narrow_weights: bool = False  # fp8 (tensorwise) linear weights travel in 1 byte
    why: str = ""  # one line: why that overlap


@dataclass(frozen=True)
class SpeedFacts:
    """What a strategy costs besides the model's own FLOPs: what dtrain.memory.speed reads."""

    collectives: tuple[Collective, ...] = ()
    # What one compiled graph covers by default: "model" (one graph, maybe cut at gradient
    # buckets: MemoryFacts.graph_split_buckets) or "blocks" (each block and the loss apart).
    graph: str = "model"
    # The share of the compiled matmul rate its eager (uncompiled) loop keeps; None: the
    # planner's EAGER_FACTOR. A strategy whose eager loop does more than the model's ops (hooks
    # per module) declares its own, measured.
    eager_factor: float | None = None
    # The share of the compiled matmul rate its compiled graph keeps, where that graph is not the
    # model's (broken at per-module hooks); None: planned as the model's graph.
    compiled_factor: float | None = None


@dataclass
class StateBytes:
    """Exact bytes of model state this rank holds (storage-deduplicated)."""

    params_bytes: int = 0
    grads_bytes: int = 0
    optim_bytes: int = 0  # optimizer states (AdamW's two moments and step)
    # An fp32 master copy of the weights kept apart from the parameters (DeepSpeed's ZeRO
    # optimizers keep one even in fp32); 0 where the parameters are the master weights.
    master_bytes: int = 0


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one bucket count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        if hasattr(t, "__tensor_flatten__"):  # e.g. 8-bit optimizer states: count their parts
            total += tensor_bytes(getattr(t, name) for name in t.__tensor_flatten__()[0])
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def compile_blocks(model: nn.Module, blocks: bool = True) -> None:
    """torch.compile each transformer block in place (parameter names unchanged; one compiled
    graph serves every block) and the loss on its own.

    Block by block is what wrappers that hook parameters between blocks need (FSDP, DDP,
    DeepSpeed); the loss compiled apart keeps the head's fp32 logits from materialising
    (dtrain.model.lm_loss; docs/strategies.md). `blocks=False` compiles only the loss, for
    hooks that break compiled blocks (DeepSpeed ZeRO-3's parameter fetches).
    """
    from dtrain.model import lm_loss

    if blocks:
        for block in model.layers.values():
            block.compile()
    model.loss_fn = torch.compile(lm_loss)


# StrategyConfig keys that only some strategies honour; each strategy lists its own in `options`.
OPTIONAL_KEYS = tuple(
    f.name for f in fields(StrategyConfig) if f.name not in ("name", "compile", "bucket_cap_mb")
)

# The values of an optional key that ask nothing of a strategy that does not honour it: its
# default, and for reshard_after_forward true too (its default before auto: a sweep pinning it
# over every strategy keeps working).
UNASKED = {"reshard_after_forward": (AUTO, True)}


class Strategy:
    name = "single"  # what the logs and checkpoint manifests call it
    names: tuple[str, ...] = ()  # the strategy=<name> choices this class serves (the registry)
    precisions: tuple[str, ...] = tuple(PRECISIONS)
    needs_distributed = False  # False: one process, so no gradients are reduced across ranks
    own_optimizer = False  # builds its optimizer itself rather than through dtrain.optim
    options: tuple[str, ...] = ()  # the OPTIONAL_KEYS this strategy honours
    composes_parallel = False  # trains with parallel.tp or parallel.cp > 1 (dtrain/parallel/)
    memory = MemoryFacts()
    speed = SpeedFacts()

    def __init__(self, cfg: StrategyConfig, precision: Precision, env: DistEnv):
        self.cfg, self.precision, self.env = cfg, precision, env
        self.device = env.device
        self.module: nn.Module | None = None  # the plain GPT (shared parameters)
        self.model: nn.Module | None = None  # what training calls (wrapped, maybe compiled)
        self.optimizer: torch.optim.Optimizer | None = None
        self._state_bytes: StateBytes | None = None
        self.loss_scaler = None  # fp16's dynamic loss scaling (dtrain.lowp.scaling.LossScaler)
        # The precision's work after each optimizer step and after each checkpoint load, its
        # state that is each rank's own and how its steps run where compiled (precision_hooks),
        # or None.
        self.post_step = self.post_load = self.rank_local = self.step_mode = None
        self.micro_batch_size, self.grad_accum_steps, self.grad_clip = 1, 1, 0.0
        self.parallel, self.seq_len = ParallelConfig(), 0  # the mesh's tp and cp (configure)
        # Why the inspector's samples and attention maps cannot run on this model, or None.
        self.inspect_note: str | None = None
        # dtrain.reliability.nonfinite.NonfiniteGuard (trainer.on_nonfinite), given to configure();
        # with fp16 the loss scaler owns inf/NaN gradients instead (overflows: skipped, never a
        # stop).
        self.nonfinite: NonfiniteGuard | None = None
        self.check()

    # --- config-time checks ------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: StrategyConfig, precision: Precision, device_type: str) -> None:
        """The checks that need no process group, for a run on `device_type` (the planner runs
        them too, for "cuda"): the precision, and options this strategy does not honour."""
        if precision.name not in cls.precisions:
            raise ConfigError(
                f"strategy={cfg.name} cannot train precision={precision.name}; "
                f"valid precisions for it: {', '.join(cls.precisions)}"
            )
        check_strategy(precision, cls, cfg.name)
        default = StrategyConfig()
        for key in OPTIONAL_KEYS:
            value = getattr(cfg, key)
            if key in cls.options or value in UNASKED.get(key, (getattr(default, key),)):
                continue
            honoured = ", ".join(cls.options) or "none of them"
            raise ConfigError(
                f"strategy.{key}={yaml_value(value)} does not apply to "
                f"strategy={cfg.name}; its options: {honoured}"
            )

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int) -> None:
        """The checks of the world size, which need no process group (the planner runs them)."""
        if world_size > 1 and not cls.needs_distributed:
            raise ConfigError(
                f"strategy={cfg.name} runs one process but the world size is {world_size}; "
                f"use strategy=ddp (or another multi-rank strategy) under torchrun"
            )

    @classmethod
    def check_parallel(cls, cfg: StrategyConfig, precision: Precision | None) -> None:
        """What this strategy refuses beside parallel.tp or parallel.cp > 1 (where it composes
        with them at all: composes_parallel); the precision's part only where one is given."""

    @classmethod
    def check_installed(cls, cfg: StrategyConfig) -> None:
        """The libraries this strategy needs to run (the planner plans it without them)."""

    def check(self) -> None:
        self.check_installed(self.cfg)
        self.check_config(self.cfg, self.precision, self.device.type)
        self.check_world(self.cfg, self.env.world_size)

    @classmethod
    def compiles(cls, cfg: StrategyConfig, device_type: str) -> bool:
        """Whether training runs compiled: strategy.compile, else on CUDA only."""
        return cfg.compile if cfg.compile is not None else device_type == "cuda"

    @property
    def compile_enabled(self) -> bool:
        return self.compiles(self.cfg, self.device.type)

    def first_step_work(self) -> str | None:
        """What makes the first step slow (said in the log while it runs), or None."""
        if self.compile_enabled:
            return "torch.compile is tracing the model and Inductor is generating its kernels"
        return None

    def compiling_step(self, first_step: int) -> int:
        """The loop step of this process where torch.compile builds the model's graphs: the
        first, or the next where the precision runs the first eagerly (fp8's dynamic step)."""
        eager = self.step_mode is not None and self.step_mode.runs_eager()
        return first_step + 1 if eager else first_step

    def slow_steps(self, first_step: int) -> dict[int, str]:
        """The loop steps of this process that run long, each with what it does then (the
        loop says it in the log while such a step runs): by default the first, which compiles.
        `first_step` is the process's first loop step (after a resume, not 1)."""
        what = self.first_step_work()
        if what and self.compiling_step(first_step) != first_step:
            # fp8's dynamic first step runs eagerly: the next one compiles
            eager = "fp8 scales this step dynamically, eagerly (no amax history yet)"
            return {first_step: eager, first_step + 1: what}
        return {first_step: what} if what else {}

    # --- what the memory planner reads -------------------------------------------------
    @classmethod
    def memory_facts(cls, name: str) -> MemoryFacts | None:
        """How a rank of strategy=<name> holds memory; None where that name cannot be planned."""
        return cls.memory

    @classmethod
    def shards_params(cls, name: str) -> bool:
        """Whether a rank of strategy=<name> holds only a shard of each parameter (fsdp, hsdp,
        zero3): what the precision choices that need whole weights read."""
        facts = cls.memory_facts(name)
        return facts is not None and "params" in facts.shards

    @classmethod
    def memory_options(cls, cfg: StrategyConfig, device_type: str) -> dict:
        """What this strategy's config means for the planner, by dtrain.memory.MemorySetup's
        field names: its name, whether it compiles and the options it honours."""
        honoured = {key: getattr(cfg, key) for key in cls.options}
        return {**honoured, "strategy": cls.name, "compile": cls.compiles(cfg, device_type)}

    @classmethod
    def speed_facts(cls, name: str, setup) -> SpeedFacts:
        """What strategy=<name> communicates per step for a planner setup (dtrain.memory's
        MemorySetup: its options can change the collectives, e.g. FSDP's resharding)."""
        return cls.speed

    # --- building ----------------------------------------------------------------------
    def configure(
        self,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
        grad_clip: float,
        nonfinite: NonfiniteGuard | None = None,
        parallel: ParallelConfig | None = None,
        seq_len: int = 0,
    ) -> None:
        """The batch shape and clipping, for strategies that must know them when built, the
        guard that clip_and_step steps through (None: a plain optimizer step) and the mesh's
        tensor and context parallel sizes (checked by dtrain.strategies.check_parallel)."""
        self.parallel, self.seq_len = parallel or ParallelConfig(), seq_len
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.grad_clip = grad_clip
        self.nonfinite = nonfinite

    def setup(self, model_cfg: ModelConfig, optim_cfg: OptimConfig, seed: int) -> None:
        self.module = build_model(model_cfg, self.device, seed)
        apply_precision(self.module, self.precision)  # dtype casts / module swaps, before wrapping
        self.model = self.wrap(self.module)
        self.optimizer = build_precision_optimizer(
            self.module, optim_cfg, self.precision, self.device
        )
        self.loss_scaler = build_loss_scaler(self.precision, self.device)
        self.post_step, self.post_load, self.rank_local, self.step_mode = precision_hooks(
            self.precision, self.module, self.device, sharded=False, compiled=self.compile_enabled
        )

    @property
    def compile_scope(self) -> str:
        """What torch.compile covers: `model` (one graph, the default where nothing hooks into
        the model) or `blocks` (each block and the loss, see compile_blocks)."""
        return self.cfg.compile_scope or "model"

    def wrap(self, module: nn.Module) -> nn.Module:
        if not self.compile_enabled:
            return module
        if self.compile_scope == "blocks":
            compile_blocks(module)
            return module
        return torch.compile(module)

    # --- training ----------------------------------------------------------------------
    def no_sync(self, last_micro: bool):
        """Context for a micro-step's backward: skip gradient sync unless it is the last."""
        return contextlib.nullcontext()

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, *, last_micro: bool, loss_div: int
    ) -> torch.Tensor:
        """One micro-step. Returns the (detached, unscaled) loss of this micro-batch."""
        with self.no_sync(last_micro), self.precision_context():
            with self.precision.autocast(self.device):
                loss = self.model(x, y)
            scaled = loss / loss_div
            if self.loss_scaler is not None:
                scaled = self.loss_scaler.scale(scaled)
            scaled.backward()
        return loss.detach()

    def clip_and_step(self, lr: float, grad_clip: float) -> torch.Tensor:
        """Clip (if grad_clip > 0), step, zero grads. Returns the pre-clip global grad norm."""
        set_lr(self.optimizer, lr)
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self.optimizer)
        if grad_clip > 0:
            norm = nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        # FSDP's norm is a DTensor (the shards' norms, reduced when read): make it one tensor
        # before it meets plain ones (the scaler's overflow count, the non-finite guard).
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if self.loss_scaler is not None:
            self.loss_scaler.step(self.optimizer, norm)  # skipped if a gradient overflowed
        elif self.nonfinite is not None:  # skips the update if the global norm is NaN/inf
            self.nonfinite.step(self.optimizer, norm)
        else:
            self.optimizer.step()
        if self.post_step is not None:
            self.post_step()
        if self._state_bytes is None and self.optimizer.state:  # grads + states exist now
            self._state_bytes = self.measure_state_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def step_metrics(self) -> dict[str, float]:
        """Extra scalars for the logs (fp16: train/overflow_steps, train/loss_scale)."""
        return self.loss_scaler.metrics() if self.loss_scaler is not None else {}

    def precision_context(self) -> contextlib.AbstractContextManager:
        """What the model's forward and backward run in for the precision: eagerly where its
        step_mode asks (fp8's dynamic first step; strategies/eager_step), else as set up."""
        if self.step_mode is not None and self.step_mode.runs_eager():
            return eager_step(self.module)
        return contextlib.nullcontext()

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast(self.device), self.precision_context():
            return self.model(x, y).detach()

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) of a forward without targets, as eval_loss runs it (every rank
        of a sharded model takes part)."""
        with self.precision.autocast(self.device), self.precision_context():
            return self.model(x).detach()

    def mean_across_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Average a scalar over data-parallel ranks (for logging the loss)."""
        if dist.is_initialized() and self.env.world_size > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t /= self.env.world_size
        return t

    # --- accounting --------------------------------------------------------------------
    def measure_state_bytes(self) -> StateBytes:
        return StateBytes(
            params_bytes=tensor_bytes(self.module.parameters()),
            grads_bytes=tensor_bytes(p.grad for p in self.module.parameters()),
            optim_bytes=tensor_bytes(optimizer_tensors(self.optimizer)),
        )

    def state_bytes(self) -> StateBytes:
        """Measured after the first step (when gradients and optimizer states exist)."""
        return self._state_bytes or self.measure_state_bytes()

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Model and optimizer state keyed by parameter names, in the form DCP saves."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self.post_load is not None:  # e.g. fp8's scales follow the weights just loaded
            self.post_load()

    def rank_state(self) -> dict:
        """What this rank alone holds and a resume needs, for its own file of a checkpoint
        (extra_rank{r}.pt): fp8 delayed scaling's amax histories, each rank's from its own
        data. {} where there is none."""
        return {} if self.rank_local is None else {"precision": self.rank_local.state_dict()}

    def load_rank_state(self, state: dict | None, from_rank: int | None = None) -> None:
        """After load_state_dict: this rank's rank_state() from the checkpoint, or where
        another number of ranks saved it, that of their rank `from_rank` (this rank modulo
        their number: fp8's amax histories estimate the same tensors' range on any rank);
        None where the checkpoint has none (saved by an older dtrain)."""
        if self.rank_local is None:
            return
        why = self.rank_local.load_state_dict(
            state.get("precision") if isinstance(state, dict) else None
        )
        name = self.precision.name
        if why is not None:
            log.info("%s: the first step after the resume scales dynamically (%s)", name, why)
        elif from_rank is not None:
            log.info(
                "%s: the amax histories come from rank %d of the checkpoint, which another "
                "number of ranks saved",
                name,
                from_rank,
            )

    def unwrapped(self) -> nn.Module:
        """The plain model (for generation, attention maps and export)."""
        return self.module
