"""strategy=fsdp: FSDP2 (`fully_shard`, DTensor parameters) per transformer block, then the root.

Every rank holds 1/world of the parameters, gradients and optimizer states (ZeRO-3); a block's
parameters are all-gathered just before its forward and backward and its gradients
reduce-scattered right after its backward. `strategy.replicate_degree=R` > 1 is HSDP: a 2-D mesh
(R replicas x world/R shards), sharding within a group (one node, fast links) and all-reducing
across groups.

The model is built on the meta device and sharded before any weight exists; each rank then
materialises only its shard. `GPT.init_weights` draws every parameter whole from its own seeded
generator and hands it to `place`, which keeps this rank's slice: FSDP starts from exactly the
weights `strategy=single` starts from, on any number of ranks.

Wrappers go on in torchtitan's order: activation checkpointing -> compile -> fully_shard.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import torch
from torch import nn

from dtrain.config import AUTO, ModelConfig, OptimConfig, StrategyConfig
from dtrain.errors import ConfigError
from dtrain.model import GPT
from dtrain.parallel.mesh import build_mesh, is_parallel
from dtrain.precision import (
    apply_precision,
    build_loss_scaler,
    build_precision_optimizer,
    precision_hooks,
)
from dtrain.strategies.base import Collective, MemoryFacts, SpeedFacts, Strategy, compile_blocks

# Selective activation checkpointing keeps the outputs of these (the expensive ops: matmuls and
# attention) and recomputes everything else (norms, activations, RoPE: cheap, memory-bound).
_SAC_SAVE = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
}


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if str(op) in _SAC_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(block: nn.Module, mode: str) -> nn.Module:
    """Wrap one block so its activations are recomputed in the backward (full) or only the
    cheap ones are (selective). DCP's state-dict helpers strip the wrapper from names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return checkpoint_wrapper(
        block,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_policy),
        preserve_rng_state=False,
    )


def sharded_scaler_optim(precision, optim_cfg: OptimConfig) -> OptimConfig:
    """The optimizer config to use beside ShardedGradScaler (fp16): not fused, since fused
    AdamW cannot take its (1,)-shaped found_inf into 0-d step counters; foreach can."""
    if precision.loss_scaling and optim_cfg.fused is not False:
        return replace(optim_cfg, fused=False)
    return optim_cfg


# Per block: gather its parameters for the forward (the next block's prefetched under this
# one's compute) and, resharded after the forward, again for the backward; reduce-scatter its
# gradients after its backward; HSDP then all-reduces each shard across the replicas. The root
# group's gathers and the first block's reduction have nothing left to hide under.
FSDP_GATHER = Collective(
    "all_gather",
    "params",
    "compute",
    group="shard",
    per_micro=True,
    calls="blocks",
    overlap=0.8,
    window="step",
    narrow_weights=True,
    why="the next block's gather is prefetched under this block's compute (fitted: 1b, 2x H200)",
)
# The backward's gather, where the forward freed the block (reshard_after_forward): keeping the
# blocks gathered instead ran 1.019x (1b bf16), 1.104x (1b fp8), 1.042x (8b bf16) and 1.022x
# (8b fp8) faster on 2x H200, a step shorter by 1.1-1.5x a whole-model gather's time at 1b bf16
# and 8b, about 1.25-1.8x this re-gather's (the blocks the forward freed: 88% of the 1b
# model's parameters, 84% of the 8b's;
# 11x at 1b fp8, where the host falls behind: bench/results/strategies/1b_2gpu.json);
# so none of it is planned as hidden.
FSDP_REGATHER = replace(
    FSDP_GATHER,
    payload="resharded",  # the last block and the root stay gathered for the backward
    calls="resharded",
    overlap=0.0,
    window="backward",
    why="the backward's re-gather shares the links with the reduce-scatters: measured exposed",
)
FSDP_COLLECTIVES = (
    FSDP_GATHER,
    FSDP_REGATHER,
    Collective(
        "reduce_scatter",
        "grads",
        "reduce",
        group="shard",
        calls="blocks",
        overlap=0.8,
        why="each block's reduce-scatter runs under the backward of the blocks before it",
    ),
    Collective(
        "all_reduce",
        "grads",
        "reduce",
        group="replicate",
        payload="shard",
        calls="blocks",
        overlap=0.8,
        why="HSDP: each shard's all-reduce follows its reduce-scatter, overlapped",
    ),
)


def resharding(cfg: StrategyConfig) -> bool:
    """strategy.reshard_after_forward as a bool. A run decides `auto` from the memory plan
    before it builds the strategy (dtrain.memory.search.resolve_auto_options); left undecided
    (a strategy built or planned on its own, with no device to size it for) it is the leaner
    choice, true."""
    return True if cfg.reshard_after_forward == AUTO else bool(cfg.reshard_after_forward)


class FSDPStrategy(Strategy):
    name = "fsdp"
    names = ("fsdp", "hsdp")  # hsdp: conf/strategy/hsdp.yaml sets replicate_degree > 1
    needs_distributed = True
    composes_parallel = True
    options = (
        "reshard_after_forward",
        "cpu_offload",
        "activation_checkpointing",
        "replicate_degree",
        "grads_on_compute_stream",
    )
    memory = MemoryFacts(
        autocast=False, shards=frozenset({"params", "grads", "optim"}), partition="dim0"
    )
    speed = SpeedFacts(collectives=FSDP_COLLECTIVES, graph="blocks")

    @classmethod
    def speed_facts(cls, name: str, setup) -> SpeedFacts:
        kept = FSDP_COLLECTIVES
        if not getattr(setup, "reshard_after_forward", True):
            # Blocks stay gathered from their forward to their backward: no re-gather.
            kept = tuple(c for c in FSDP_COLLECTIVES if c is not FSDP_REGATHER)
        if getattr(setup, "tp", 1) > 1:
            from dtrain.parallel.tensor import TP_COLLECTIVES

            kept += TP_COLLECTIVES
        if getattr(setup, "cp", 1) > 1:
            from dtrain.parallel.context import CP_COLLECTIVES

            kept += CP_COLLECTIVES
        return cls.speed if kept == FSDP_COLLECTIVES else replace(cls.speed, collectives=kept)

    @classmethod
    def memory_options(cls, cfg: StrategyConfig, device_type: str) -> dict:
        return {
            **super().memory_options(cfg, device_type),
            "reshard_after_forward": resharding(cfg),
        }

    @classmethod
    def check_world(cls, cfg: StrategyConfig, world_size: int) -> None:
        super().check_world(cfg, world_size)
        world, r = world_size, cfg.replicate_degree
        if world % r:
            raise ConfigError(
                f"strategy.replicate_degree={r} does not divide the world size {world}; "
                f"choose a divisor of {world} (replica groups x shards per group = world size)"
            )

    @classmethod
    def check_parallel(cls, cfg: StrategyConfig, precision) -> None:
        if cfg.replicate_degree > 1:
            raise ConfigError(
                f"strategy.replicate_degree={cfg.replicate_degree} (HSDP) does not compose with "
                "parallel.tp or parallel.cp; use strategy.replicate_degree=1"
            )
        if precision is not None and (precision.quantize or precision.optimizer_8bit):
            raise ConfigError(
                f"precision={precision.name} swaps modules that parallel.tp and parallel.cp do "
                "not split; choose precision=fp32, bf16, bf16-true or fp16"
            )

    # --- building ----------------------------------------------------------------------
    def build_mesh(self):
        """The mesh FSDP shards over: the world, HSDP's (replicate, shard) or, beside tensor or
        context parallelism, the flattened dp x cp dimension of self.parallel_mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        world, r = self.env.world_size, self.cfg.replicate_degree
        if is_parallel(self.parallel):
            self.parallel_mesh, dp_cp = build_mesh(self.device.type, world, self.parallel)
            return dp_cp
        if r > 1:
            return init_device_mesh(
                self.device.type, (r, world // r), mesh_dim_names=("replicate", "shard")
            )
        return init_device_mesh(self.device.type, (world,), mesh_dim_names=("shard",))

    def setup(self, model_cfg: ModelConfig, optim_cfg: OptimConfig, seed: int) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import distribute_tensor

        reshard = resharding(self.cfg)
        self.mesh = self.build_mesh()
        p = self.precision
        mp = MixedPrecisionPolicy(
            param_dtype=p.compute_dtype if p.mixed else None, reduce_dtype=p.reduce_dtype
        )
        shard_kw: dict = {"mesh": self.mesh, "mp_policy": mp}
        if self.cfg.cpu_offload:
            shard_kw["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")

        with torch.device("meta"):
            model = GPT(model_cfg)
        # dtype casts and module swaps (int8/fp8 linears) before any wrapping; fp8 then
        # all-gathers its weights in fp8.
        apply_precision(model, p, sharded=True)
        if is_parallel(self.parallel):  # TP and CP first: FSDP then shards their DTensors
            from dtrain.parallel.apply import apply_parallel

            apply_parallel(
                model, self.parallel_mesh, self.parallel, seq_len=self.seq_len, device=self.device
            )
            self.inspect_note = "the model is split by parallel.tp/cp"
        blocks = list(model.layers.items())
        for i, (key, block) in enumerate(blocks):
            if self.cfg.activation_checkpointing != "none":
                block = apply_activation_checkpointing(block, self.cfg.activation_checkpointing)
            if self.compile_enabled:
                block.compile()  # in place: parameter names stay those of the plain model
            # The last block's parameters are needed again at once by the backward: keeping
            # them gathered saves one all-gather (torchtitan does the same).
            last = i == len(blocks) - 1
            fully_shard(block, reshard_after_forward=reshard and not last, **shard_kw)
            model.layers[key] = block
        if self.compile_enabled:
            compile_blocks(model, blocks=False)  # the loss (blocks were compiled above)
        # The root takes what is left: embeddings (tied or not), final norm, output layer.
        fully_shard(model, reshard_after_forward=reshard, **shard_kw)
        if self.grads_on_compute_stream:
            grads_from_compute_pool([model, *model.layers.values()], self.device)

        # Materialise only this rank's shards; offloaded shards live in host memory.
        model.to_empty(device="cpu" if self.cfg.cpu_offload else self.device)
        model.tie_weights()

        def place(param: torch.Tensor, full: torch.Tensor) -> None:
            # src_data_rank=None: every rank already holds the same full tensor (same seed),
            # so each keeps its slice with no communication.
            local = distribute_tensor(
                full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
            )
            param.copy_(local)

        model.init_weights(seed, place=place)
        if self.cfg.cpu_offload and self.device.type == "cuda":
            model.rope_cache = model.rope_cache.to(self.device)  # a buffer FSDP does not move
        self.module = self.model = model
        optim_cfg = sharded_scaler_optim(p, optim_cfg)
        self.optimizer = build_precision_optimizer(model, optim_cfg, p, self.device)
        self.loss_scaler = build_loss_scaler(p, self.device, sharded=True)
        # The shards' fp8 cast compiles where the blocks do, unless the shards are offloaded.
        compiled = self.compile_enabled and not self.cfg.cpu_offload
        self.post_step, self.post_load, self.rank_local, self.step_mode = precision_hooks(
            p, model, self.device, sharded=True, compiled=compiled
        )

    @property
    def grads_on_compute_stream(self) -> bool:
        """strategy.grads_on_compute_stream, where it applies: CUDA, one replica group (HSDP
        all-reduces the gradients on a third stream), gradients on the GPU. With a reduce dtype
        other than the parameters' (precision.reduce_dtype=bf16) only the reduced buffer comes
        from the compute stream: FSDP2 casts it back on its own stream (the planner counts it)."""
        c = self.cfg
        return (
            c.grads_on_compute_stream
            and self.device.type == "cuda"
            and c.replicate_degree == 1
            and not c.cpu_offload
        )

    # --- training ----------------------------------------------------------------------
    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of the batch: all of them, or its chunks under context
        parallelism (the positions dtrain.parallel.context gave the model)."""
        positions = self.module.positions
        if positions is None:
            return x, y
        return x.index_select(1, positions), y.index_select(1, positions)

    def forward_backward(self, x, y, *, last_micro: bool, loss_div: int) -> torch.Tensor:
        x, y = self.local_batch(x, y)
        loss = super().forward_backward(x, y, last_micro=last_micro, loss_div=loss_div)
        return plain(loss)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return plain(super().eval_loss(*self.local_batch(x, y)))

    def precision_context(self) -> contextlib.AbstractContextManager:
        """The precision's, and under parallel.loss_parallel torch's loss_parallel: the loss
        and its backward over the vocabulary-split logits."""
        context = super().precision_context()
        if self.parallel.tp == 1 or not self.parallel.loss_parallel:
            return context
        from torch.distributed.tensor.parallel import loss_parallel

        stack = contextlib.ExitStack()
        stack.enter_context(context)
        stack.enter_context(loss_parallel())
        return stack

    def no_sync(self, last_micro: bool):
        # Non-final micro-steps accumulate unsharded gradients locally; the final one
        # reduce-scatters (and, for HSDP, all-reduces across replicas) the sum once.
        self.model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()


def plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss as one tensor: loss_parallel's is a DTensor replicated over the tp ranks."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def grads_from_compute_pool(modules: list[nn.Module], device: torch.device) -> bool:
    """Allocate FSDP2's reduce-scatter outputs, which the sharded gradients then are, from the
    compute stream's memory instead of the reduce-scatter stream's; returns whether it could.

    The caching allocator keeps one pool per stream, and FSDP2 allocates each reduce-scatter's
    output under its reduce-scatter stream: the gradients, which grow as the backward frees
    activations on the compute stream, cannot take that freed memory, so the run reserves both.
    At 8b under fsdp on 2x H200 (bf16, seq 8192) that stream reserved 14.96 GiB, all the fp32
    gradient shards, beside the compute stream's 90.74: 108.65 GiB reserved for 90.50 allocated
    (profile.memory_snapshot_steps, raw outputs of 2026-11-27).

    Safe because FSDP2 makes the reduce-scatter stream wait for the compute stream just before
    it allocates the output (so no compute kernel still reads memory handed out here), the
    compute stream waits for the reduction before the optimizer step, and record_stream keeps a
    freed output from being reused before the reduce-scatter stream is done with it."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:  # torch < 2.8: FSDP2's own allocation
        return False
    if not all(hasattr(m, "set_custom_reduce_scatter") for m in modules):
        return False
    compute = torch.cuda.default_stream(device)

    class ComputePoolReduceScatter(DefaultReduceScatter):
        def allocate(self, size, *, dtype, device):
            # The reduce-scatter stream for the output; for the input FSDP2 calls this on the
            # compute stream, where nothing needs recording.
            stream = torch.cuda.current_stream(device)
            with torch.cuda.stream(compute):
                out = torch.empty(*size, dtype=dtype, device=device)
            if stream != compute:
                out.record_stream(stream)
            return out

    comm = ComputePoolReduceScatter()
    for m in modules:
        m.set_custom_reduce_scatter(comm)
    return True
