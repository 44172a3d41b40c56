"""The plan: what a rank holds at its peak, and the largest micro-batch that fits."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from dtrain.hardware import GiB
from dtrain.memory.activations import (
    autocast_weight_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    loss_transient_bytes,
    quantized_inputs,
)
from dtrain.memory.setup import MemorySetup, check_setup
from dtrain.memory.state import (
    ModelState,
    ds_reduce_bucket_bytes,
    model_state_bytes,
    param_shapes,
    state_bytes_per_element,
    zero_partition,
    zero_step_copy_bytes,
)
from dtrain.model import ModelConfig

# The CUDA context (driver, kernels loaded lazily) lives outside PyTorch's caching allocator:
# nvidia-smi shows it, torch.cuda.max_memory_reserved does not.
CUDA_CONTEXT_BYTES = int(0.6 * GiB)
# Reserved exceeds allocated (blocks rounded up, freed blocks of other sizes kept): a share of
# the memory that churns every step, stated for expandable segments (docs/memory.md).
ALLOCATOR_SLACK = 0.10
# Compiled DDP on CUDA with buckets under DDP_SMALL_BUCKET_MB held this many gradient-sized
# buffers beyond its planned terms: an empirical term from one model (docs/memory.md).
DDP_EXTRA_GRAD_BUFFERS = 2
DDP_SMALL_BUCKET_MB = 200


@dataclass
class MemoryPlan:
    """Bytes per GPU for one rank. `peak_bytes` is what the caching allocator reserves."""

    params_bytes: int
    grads_bytes: int
    optim_bytes: int  # the optimizer's states (AdamW's moments and step counters)
    activations_bytes: int
    transient_bytes: int
    overhead_bytes: int  # allocator slack (inside reserved) + CUDA context (outside it)
    context_bytes: int  # the CUDA-context part of overhead_bytes
    peak_bytes: int  # predicted torch peak reserved (= total_bytes - context_bytes)
    at_peak: dict[str, int]  # what is alive at the peak, by part; sums to total_bytes
    host_bytes: int = 0  # offloaded model state (CPU memory per rank)
    master_bytes: int = 0  # a master copy of the weights apart from the params (DeepSpeed)
    phase: str = "backward"  # which moment is the peak: backward | step
    n_params: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optim_bytes + self.master_bytes

    @property
    def total_bytes(self) -> int:
        """Everything the GPU must hold: the peak reserved plus the CUDA context."""
        return self.peak_bytes + self.context_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        d["model_state_bytes"] = self.model_state_bytes
        return d


def plan_memory(cfg: ModelConfig, setup: MemorySetup) -> MemoryPlan:
    """Predicted bytes per GPU for rank `setup.rank` (see the package docstring)."""
    check_setup(cfg, setup)
    shapes = param_shapes(cfg, setup.tp)
    state = model_state_bytes(shapes, setup)
    params, grads, optim, host = _on_device(state, setup)
    notes = state.notes
    # Context parallelism: each rank holds seq_len / cp tokens of every sequence.
    local = replace(setup, seq_len=setup.seq_len // setup.cp)
    activations = (
        cfg.n_layer
        * (layer_activation_bytes(cfg, local) // setup.tp + gathered_kv_bytes(cfg, setup))
        + head_activation_bytes(cfg, local) // logit_split(setup)
        + autocast_weight_bytes(cfg, local)
    )
    gathered = _gathered_bytes(cfg, setup) // setup.tp
    transient = (
        loss_transient_bytes(cfg, local) // logit_split(setup)
        + gathered
        + _recompute_bytes(cfg, local) // setup.tp
    )
    if _graph_split_by_small_buckets(setup):
        transient += DDP_EXTRA_GRAD_BUFFERS * grads
        notes.append(
            f"DDP on CUDA with {setup.ddp_bucket_mb} MB buckets: +{DDP_EXTRA_GRAD_BUFFERS}x the "
            "gradient bytes measured beyond its buckets (an empirical term, see docs/memory.md)"
        )
    # The two moments that can be the peak: the start of backward and the optimizer step.
    backward = {
        "params": params,
        "grads": _grads_at_backward(cfg, setup, grads),
        "optim": optim,
        "activations": activations,
        "transient": transient,
    }
    step = {
        "params": params,
        "grads": grads,
        "optim": optim,
        "activations": 0,
        "transient": _step_transient(shapes, setup, grads, gathered),
    }
    cache = _fp8_shard_cache_bytes(cfg, setup)
    if cache:  # alive from one optimizer step to the next: at both moments
        backward["transient"] += cache
        step["transient"] += cache
        notes.append(
            f"fp8 under fsdp: each block-linear weight shard's fp8 copy, cast once per step and "
            f"kept for its all-gathers (dtrain.lowp.fp8): +{cache / 2**30:.2f} GiB"
        )
    phase = "backward" if sum(backward.values()) >= sum(step.values()) else "step"
    at_peak = backward if phase == "backward" else step

    context, slack = 0, 0
    if setup.device == "cuda":
        context = CUDA_CONTEXT_BYTES
        slack = int(ALLOCATOR_SLACK * (activations + transient))
    at_peak["overhead"] = slack + context
    master = state.master if optim else 0  # offloaded with the optimizer states
    return MemoryPlan(
        params_bytes=params,
        grads_bytes=grads,
        optim_bytes=optim - master,
        master_bytes=master,
        activations_bytes=activations,
        transient_bytes=transient,
        overhead_bytes=slack + context,
        context_bytes=context,
        peak_bytes=sum(at_peak.values()) - context,
        at_peak=at_peak,
        host_bytes=host,
        phase=phase,
        n_params=sum(math.prod(sh) for sh in param_shapes(cfg)),
        notes=notes,
    )


def _on_device(state: ModelState, setup: MemorySetup) -> tuple[int, int, int, int]:
    """(params, grads, optimizer states with the master copy) left on the GPU, and the bytes
    offloaded to the host, by the offload options the strategy honours."""
    params, grads, optim, host = state.params, state.grads, state.optim + state.master, 0
    if setup.cpu_offload and setup.honours("cpu_offload"):
        host, params, grads, optim = params + grads + optim, 0, 0, 0
        state.notes.append("cpu_offload: sharded params, grads and optimizer states on the host")
    if setup.offload_optimizer and setup.honours("offload_optimizer"):
        host, optim = host + optim, 0
        state.notes.append("offload_optimizer: optimizer states and fp32 master on the host")
    sharded = "params" in setup.facts.shards
    if setup.offload_params and setup.honours("offload_params") and sharded:
        host, params = host + params, 0
        state.notes.append("offload_params: parameter partitions on the host")
    return params, grads, optim, host


def _block_numel(cfg: ModelConfig) -> int:
    hd = cfg.head_dim
    return (
        2 * cfg.d_model * cfg.n_head * hd
        + 2 * cfg.d_model * cfg.n_kv_head * hd
        + (3 * cfg.d_model * cfg.ffn_hidden + 2 * cfg.d_model)
    )


def logit_split(setup: MemorySetup) -> int:
    """The ranks the logits are split over: tp under parallel.loss_parallel, else 1."""
    return setup.tp if setup.loss_parallel else 1


def gathered_kv_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Context parallelism: one block's keys and values of the whole sequence, gathered from
    every cp rank and saved for the backward (this rank's heads: 1/tp of them)."""
    if setup.cp == 1:
        return 0
    kv = -(-cfg.n_kv_head // setup.tp) * cfg.head_dim
    return 2 * setup.micro_batch_size * setup.seq_len * kv * setup.precision.compute_dtype.itemsize


def _recompute_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Under activation checkpointing the backward re-runs one block's forward: its full
    activations exist for a moment."""
    if setup.activation_checkpointing == "none":
        return 0
    return layer_activation_bytes(cfg, replace(setup, activation_checkpointing="none"))


def _gathered_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """What a sharding strategy gathers or reduces through, alive at the start of backward."""
    partition, pr = setup.facts.partition, setup.precision
    c = pr.compute_dtype.itemsize
    block = _block_numel(cfg)
    emb = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2) + cfg.d_model
    if partition == "dim0":
        # FSDP2: the root group (embeddings, final norm, output) stays unsharded from forward
        # through backward; each block is gathered with the next one prefetched, and its
        # unsharded gradients exist before the reduce-scatter. fp8 (tensorwise) gathers the
        # linear weights in 1 byte (dtrain.lowp.fp8); the norm gains stay in c bytes.
        unsharded = block * c
        if quantized_inputs(setup) == "fp8" and getattr(pr, "fp8_weight_gather", False):
            norms = 2 * cfg.d_model
            unsharded = (block - norms) + norms * c
        gathered = emb * c + 2 * unsharded + block * (c + pr.reduce_dtype.itemsize)
        if not setup.reshard_after_forward:  # every block stays gathered until its backward
            gathered += (cfg.n_layer - 2) * unsharded
        return gathered
    if partition == "flat":  # ZeRO-3: two gathered blocks, the root, two buckets
        return 2 * block * c + emb * c + 2 * setup.ds_bucket_elements * c
    if partition == "groups":  # ZeRO-1/2: the reduce buckets, allocated at full size
        return ds_reduce_bucket_bytes(setup)
    return 0


def _fp8_shard_cache_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """fp8 (tensorwise) under FSDP2 casts each block-linear weight shard to fp8 once per
    optimizer step and keeps it (install_cached_weight_cast): one byte per element of this
    rank's shards. 8b on 2x H200 allocated 85.80 GiB against a 78.66 GiB peak planned without it."""
    pr = setup.precision
    if setup.facts.partition != "dim0" or quantized_inputs(setup) != "fp8":
        return 0
    if not getattr(pr, "fp8_weight_gather", False) or setup.world_size < 2:
        return 0
    shard = setup.world_size // max(1, setup.replicate_degree)
    linears = cfg.n_layer * (_block_numel(cfg) - 2 * cfg.d_model)  # but the two norm gains
    return math.ceil(linears / shard)


def _graph_split_by_small_buckets(setup: MemorySetup) -> bool:
    """Where the empirical DDP term applies: compiled, on CUDA, 2+ ranks, small buckets."""
    return (
        setup.facts.graph_split_buckets
        and setup.compile
        and setup.ddp_bucket_mb < DDP_SMALL_BUCKET_MB
        and setup.device == "cuda"
        and setup.world_size > 1
    )


def _grads_at_backward(cfg: ModelConfig, setup: MemorySetup, grads: int) -> int:
    """The gradients alive beside all the activations as a backward starts."""
    facts = setup.facts
    if facts.partition == "groups":
        # ZeRO-1/2's step frees the partition buffer and the next backward allocates it at its
        # first reduction: only earlier micro-steps' gradients meet the activations.
        return grads if setup.grad_accum_steps > 1 else 0
    if facts.persistent_grads:
        return grads
    if facts.shards:
        return grads if fsdp_grads_pool_apart(setup) else 0
    # set_to_none: gradients are rebuilt while activations are freed, the output layer's first.
    return min(grads, cfg.vocab_size * cfg.d_model * setup.precision.param_dtype.itemsize)


def fsdp_grads_pool_apart(setup: MemorySetup) -> bool:
    """FSDP2 on CUDA allocates the gradient shards under its reduce-scatter stream, whose pool
    of the caching allocator the compute stream cannot use: the shards then add to reserved
    memory beside the compute stream's peak (8b, 2x H200: 14.96 GiB), unless dtrain hands
    them the compute stream's memory (strategy.grads_on_compute_stream, one replica group,
    gradients reduced in their own dtype)."""
    if setup.device != "cuda" or setup.facts.partition != "dim0" or setup.cpu_offload:
        return False
    pr = setup.precision
    if pr.reduce_dtype != pr.param_dtype:  # FSDP2 casts the reduced shards back to the param
        return True  # dtype on its reduce-scatter stream: a new allocation in its own pool
    return not (setup.grads_on_compute_stream and setup.replicate_degree == 1)


def _step_transient(shapes, setup: MemorySetup, grads: int, gathered: int) -> int:
    """Transients at the optimizer step. ZeRO-1/2: the boundary reduction (the gradients held
    and the buckets), then the step (the partition buffer and one group's flat fp32 copy)."""
    if setup.facts.partition != "groups":
        return gathered
    zp = zero_partition(shapes, setup)
    g = state_bytes_per_element(setup.precision, fp32_master=True).grad
    step = zp.overlap_elements * g + zero_step_copy_bytes(zp, setup)
    return max(grads + gathered, step) - grads


def largest_micro_batch(
    cfg: ModelConfig, setup: MemorySetup, capacity_bytes: int, limit: int = 4096
) -> int:
    """The largest micro-batch whose predicted total fits `capacity_bytes` (0: none fits).

    Memory grows monotonically with the micro-batch, so a doubling then bisection search."""

    def fits(mb: int) -> bool:
        return plan_memory(cfg, replace(setup, micro_batch_size=mb)).total_bytes <= capacity_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
