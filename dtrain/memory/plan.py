"""The plan: what a rank holds at its peak, and the largest micro-batch that fits."""

from __future__ import annotations

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
    _itemsize,
    _numel,
    ds_reduce_bucket_bytes,
    model_state_bytes,
    param_shapes,
    state_bytes_per_element,
    zero_partition,
    zero_step_copy_bytes,
)
from dtrain.model import ModelConfig

# The CUDA context (driver, kernels of torch/cuBLAS/NCCL loaded lazily) lives outside PyTorch's
# caching allocator: nvidia-smi shows it, torch.cuda.max_memory_reserved does not.
CUDA_CONTEXT_BYTES = int(0.6 * GiB)
# Reserved exceeds allocated: the caching allocator rounds blocks up and keeps freed blocks of
# other sizes. A stated fraction of the dynamic (activation + transient) memory, the part that
# churns every step. It holds for dtrain's default allocator, expandable segments
# (dtrain.dist.allocator_settings): measured reserved-minus-allocated 0.0-2.4 GiB on 350m and
# 0.3-3.1 GiB on 1b. With the allocator's classic segments (trainer.expandable_segments=false
# or a PYTORCH_CUDA_ALLOC_CONF without them) FSDP and DeepSpeed held 4-10 GiB more on 1b than
# they allocated, which this fraction does not cover (docs/memory.md).
ALLOCATOR_SLACK = 0.10
# DDP on CUDA with small buckets holds memory beyond its gradient buckets that the terms below do
# not explain: on the 1b model (bf16, micro-batch 8 x 2048, 2 GPUs) with torch's 25 MB buckets
# the peak allocated was 60.3 GiB with plain DDP, Lightning Fabric's DDP and dtrain's alike
# (whole-model compile; 61.8 GiB compiled per block), ~7 GiB more than with 200, 400 or 1000 MB
# buckets (53.0-53.3 GiB), where the plan needs no extra term (the default run: 55.3 GiB
# reserved predicted, 55.6 measured). It comes with the ~200 graphs Dynamo cuts at 25 MB bucket
# boundaries, so it is planned for compiled DDP only (eager DDP was not measured), below
# DDP_SMALL_BUCKET_MB (nothing was measured between 25 and 200), as this many gradient-sized
# buffers: an empirical term fitted on that one model (docs/memory.md).
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


def _block_numel(cfg: ModelConfig) -> int:
    hd = cfg.head_dim
    return (
        2 * cfg.d_model * cfg.n_head * hd
        + 2 * cfg.d_model * cfg.n_kv_head * hd
        + (3 * cfg.d_model * cfg.ffn_hidden + 2 * cfg.d_model)
    )


def plan_memory(cfg: ModelConfig, setup: MemorySetup) -> MemoryPlan:
    """Predicted bytes per GPU for rank `setup.rank` (see the module docstring)."""
    check_setup(cfg, setup)
    shapes = param_shapes(cfg)
    n_params = sum(_numel(sh) for sh in shapes)
    state = model_state_bytes(shapes, setup)
    params, grads, notes, master = state.params, state.grads, state.notes, state.master
    optim = state.optim + master  # planned together: both live with the optimizer
    pr, s = setup.precision, setup.strategy
    c = _itemsize(pr.compute_dtype)

    # Offloaded state lives on the host; the GPU keeps none of it.
    host = 0
    if s == "fsdp" and setup.cpu_offload:
        host, params, grads, optim = params + grads + optim, 0, 0, 0
        notes.append("cpu_offload: sharded params, grads and optimizer states on the host")
    if s.startswith("zero") and setup.offload_optimizer:
        host += optim
        optim = 0
        notes.append("offload_optimizer: optimizer states and fp32 master on the host")
    if s == "zero3" and setup.offload_params:
        host += params
        params = 0
        notes.append("offload_params: parameter partitions on the host")

    layers = cfg.n_layer * layer_activation_bytes(cfg, setup)
    head = head_activation_bytes(cfg, setup)
    activations = layers + head + autocast_weight_bytes(cfg, setup)
    loss_tmp = loss_transient_bytes(cfg, setup)

    # Transients besides the loss, alive at the start of backward.
    block = _block_numel(cfg)
    emb = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2) + cfg.d_model
    transient = loss_tmp
    recompute = 0
    if setup.activation_checkpointing != "none":
        # Backward re-runs one block's forward: its full activations exist for a moment.
        eager = replace(setup, activation_checkpointing="none")
        recompute = layer_activation_bytes(cfg, eager)
    gathered = 0
    if s == "fsdp":
        # The root group (embeddings, final norm, output) stays unsharded in the compute dtype
        # from forward through backward; each block is all-gathered (c bytes) with the next one
        # prefetched, and its unsharded gradients (c bytes, cast for the reduce) exist before
        # the reduce-scatter. Without resharding after forward every block stays gathered.
        # precision=fp8 (tensorwise) all-gathers the blocks' linear weights in fp8 (1 byte;
        # dtrain.lowp.fp8, enable_fsdp_float8_all_gather); their norm gains stay in c bytes.
        unsharded = block * c
        if quantized_inputs(setup) == "fp8" and getattr(pr, "fp8_recipe", "") == "tensorwise":
            norms = 2 * cfg.d_model
            unsharded = (block - norms) + norms * c
        gathered = emb * c + 2 * unsharded + block * (c + _itemsize(pr.reduce_dtype))
        if not setup.reshard_after_forward:
            gathered += (cfg.n_layer - 2) * unsharded
    elif s == "zero3":
        gathered = 2 * block * c + emb * c + 2 * setup.ds_bucket_elements * c
    elif s in ("zero1", "zero2"):
        # The reduce buckets (gradients waiting for their reduce), allocated at full size.
        gathered = ds_reduce_bucket_bytes(setup)
    transient += gathered + recompute
    split_graph = setup.compile and setup.ddp_bucket_mb < DDP_SMALL_BUCKET_MB
    if s == "ddp" and setup.device == "cuda" and setup.world_size > 1 and split_graph:
        transient += DDP_EXTRA_GRAD_BUFFERS * grads
        notes.append(
            f"DDP on CUDA with {setup.ddp_bucket_mb} MB buckets: +{DDP_EXTRA_GRAD_BUFFERS}x the "
            "gradient bytes measured beyond its buckets (an empirical term, see docs/memory.md)"
        )

    # Which gradients coexist with all the activations at the start of backward?
    # Persistent gradient buffers (DDP's buckets, DeepSpeed's flat partitions) do; gradients
    # that zero_grad(set_to_none) frees (single, FSDP) are rebuilt while activations are freed,
    # so only the output layer's gradient exists yet.
    persistent_grads = grads if s in ("ddp", "zero1", "zero2", "zero3") else 0
    head_grad = min(grads, cfg.vocab_size * cfg.d_model * _itemsize(pr.param_dtype))
    grads_at_backward = max(persistent_grads, head_grad if s == "single" else 0)
    if s == "fsdp":
        grads_at_backward = 0
    if s in ("zero1", "zero2"):
        # Only gradients of earlier micro-steps exist as a backward starts: the optimizer step
        # frees the partition buffer, the next backward allocates it again (at its first
        # reduction, with activations already being freed). On 2x H200 (1b, bf16) zero1 and
        # zero2 peaked at the same 45.32 GiB allocated.
        grads_at_backward = grads if setup.grad_accum_steps > 1 else 0
    backward_peak = params + optim + grads_at_backward + activations + transient
    step_transient = gathered
    if s in ("zero1", "zero2"):
        # After the backward: the boundary reduction (the gradients held, see
        # zero1_grad_elements, and the buckets), then the optimizer step (the partition
        # buffer and one group's flat fp32 gradient partition).
        zp = zero_partition(shapes, setup)
        g = state_bytes_per_element(pr, deepspeed=True).grad
        step = zp.overlap_elements * g + zero_step_copy_bytes(zp, setup)
        step_transient = max(grads + gathered, step) - grads
    step_peak = params + optim + grads + step_transient
    phase = "backward" if backward_peak >= step_peak else "step"

    if setup.device == "cuda":
        context = CUDA_CONTEXT_BYTES
        slack = int(ALLOCATOR_SLACK * (activations + transient))
    else:
        context = slack = 0
    if phase == "backward":
        at_peak = {
            "params": params,
            "grads": grads_at_backward,
            "optim": optim,
            "activations": activations,
            "transient": transient,
        }
    else:
        at_peak = {
            "params": params,
            "grads": grads,
            "optim": optim,
            "activations": 0,
            "transient": step_transient,
        }
    at_peak["overhead"] = slack + context
    peak = sum(at_peak.values()) - context
    return MemoryPlan(
        params_bytes=params,
        grads_bytes=grads,
        optim_bytes=optim - (master if optim else 0),
        master_bytes=master if optim else 0,
        activations_bytes=activations,
        transient_bytes=transient,
        overhead_bytes=slack + context,
        context_bytes=context,
        peak_bytes=peak,
        at_peak=at_peak,
        host_bytes=host,
        phase=phase,
        n_params=n_params,
        notes=notes,
    )


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
