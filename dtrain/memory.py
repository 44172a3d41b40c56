"""Predicted memory per GPU, and the compute budget of a run.

    plan = plan_memory(model_cfg, MemorySetup(strategy="fsdp", precision=PRECISIONS["bf16"],
                                              world_size=8, micro_batch_size=4, seq_len=2048))
    plan.total_bytes, plan.at_peak

What a rank holds, in five parts:

* **Model state** (params, grads, optimizer states, a separate master copy): exact. Every
  parameter tensor of the model is listed from its config and laid out the way each strategy
  stores it: whole (single, DDP), one padded shard per tensor (FSDP2, ZeRO-3), or flat
  partitions (ZeRO-1/2). Bytes
  come from the Precision's dtypes, never from its name. AdamW keeps exp_avg and exp_avg_sq per
  parameter plus a 0-d fp32 `step` tensor per parameter tensor. This reproduces, to the byte, the
  `params_bytes`/`grads_bytes`/`optim_bytes`/`master_bytes` that strategies measure (tests
  check it).
  In Ψ units this is the ZeRO paper's table (Rajbhandari et al. 2019): DDP (2+2+K)Ψ, ZeRO-1
  (2+2)Ψ + KΨ/N, ZeRO-2 2Ψ + (2+K)Ψ/N, ZeRO-3/FSDP (2+2+K)Ψ/N, with our byte counts.
* **Activations** saved for backward: Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models") count sbh(34 + 5as/h) bytes per layer for GPT at 16 bits. We
  count our own blocks tensor by tensor instead (see `layer_activation_bytes`): fused SDPA keeps
  no s x s scores (the 5as/h term goes; a log-sum-exp of b·a·s fp32 stays), SwiGLU keeps three
  f-wide tensors plus its product, RMSNorm keeps its fp32 input, and the residual stream stays in
  the parameter dtype under autocast. Quantized linears (precision=int8, fp8) change what is
  kept for the matmuls' backward: int8 inputs and per-token scales eagerly; compiled, only the
  scales (the quantized operands are recomputed).
* **Transient** buffers at the peak: the logits and the fp32 loss at the start of backward,
  FSDP's all-gathered block (plus the prefetched next one) and its unsharded gradients, DeepSpeed's
  communication buckets, the recomputed block under activation checkpointing.
* **Fixed overhead**: the CUDA context (outside what PyTorch reserves) and the caching allocator's
  slack (reserved minus allocated).

Gradients do not always live at the same time as activations: with set_to_none, gradients are
created during backward while activations are freed. `peak_bytes` takes the larger of the two
phases (start of backward, optimizer step); `at_peak` shows what is alive at that peak.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from dtrain.config import DDP_BUCKET_MB
from dtrain.model import ModelConfig, count_params, flops_per_token

GiB = 1024**3


# Usable capacity (what torch.cuda reports as total_memory, approximately) and dense peak
# FLOP/s from the datasheets (SXM parts; 16-bit tensor cores, TF32, and plain fp32).
@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bf16_flops: float
    tf32_flops: float
    fp32_flops: float


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h200-141gb", int(139.8 * GiB), 989e12, 494.7e12, 67e12),
        GpuSpec("h100-80gb", int(79.1 * GiB), 989e12, 494.7e12, 67e12),
        GpuSpec("h100-pcie-80gb", int(79.1 * GiB), 756e12, 378e12, 51e12),
        GpuSpec("a100-80gb", int(79.1 * GiB), 312e12, 156e12, 19.5e12),
        GpuSpec("a100-40gb", int(39.4 * GiB), 312e12, 156e12, 19.5e12),
        GpuSpec("l40s-48gb", int(44.4 * GiB), 362e12, 183e12, 91.6e12),
        GpuSpec("a10g-24gb", int(22.0 * GiB), 125e12, 62.5e12, 31.2e12),
        GpuSpec("l4-24gb", int(22.0 * GiB), 121e12, 60e12, 30.3e12),
        GpuSpec("rtx4090-24gb", int(23.6 * GiB), 165e12, 82.6e12, 82.6e12),
    )
}

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


# --- model state --------------------------------------------------------------------------


def param_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the model's parameter tensors in `GPT.parameters()` order (tied ones once).

    Written from dtrain/model.py's constructors rather than by building the model on the meta
    device (which takes seconds for large presets and is repeated by the micro-batch search);
    a test checks the two agree.
    """
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_hidden
    block = [
        (d,),  # attn_norm
        (cfg.n_head * hd, d),  # wq
        (cfg.n_kv_head * hd, d),  # wk
        (cfg.n_kv_head * hd, d),  # wv
        (d, cfg.n_head * hd),  # wo
        (d,),  # ffn_norm
        (f, d),  # w1
        (f, d),  # w3
        (d, f),  # w2
    ]
    shapes = [(cfg.vocab_size, d)] + block * cfg.n_layer + [(d,)]
    if not cfg.tie_embeddings:
        shapes.append((cfg.vocab_size, d))
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StateBytesPerElement:
    """Bytes per parameter element of each kind of model state, from a Precision's fields."""

    param: int  # the parameter tensor the model computes with or shards
    grad: int
    optim: int  # the optimizer's states: AdamW's two moments
    master: int = 0  # a master copy of the weights kept apart from the parameters
    step: int = 4  # the 0-d fp32 `step` tensor, per parameter tensor (or flat group)


def state_bytes_per_element(precision, deepspeed: bool = False) -> StateBytesPerElement:
    """torch AdamW keeps its moments in the parameter's dtype (zeros_like), so `optim_dtype`
    differing from `param_dtype` means an optimizer that keeps its own copies: a master copy
    (`master_dtype`, when the Precision has one) and moments in `optim_dtype`.

    DeepSpeed's ZeRO optimizers always keep an fp32 master partition apart from the module's
    parameters (even in fp32), plus the moments; under a 16-bit compute dtype the module itself
    is cast to it: ZeRO's 2 + 2 + 12 bytes.
    """
    p = _itemsize(precision.param_dtype)
    o = _itemsize(precision.optim_dtype)
    if deepspeed:
        w = _itemsize(precision.compute_dtype) if precision.mixed else p
        return StateBytesPerElement(param=w, grad=w, optim=2 * o, master=4)
    master = getattr(precision, "master_dtype", None)
    extra = _itemsize(master) if master is not None and master != precision.param_dtype else 0
    return StateBytesPerElement(param=p, grad=p, optim=2 * o, master=extra)


@dataclass
class ModelState:
    """Bytes of model state one rank holds."""

    params: int
    grads: int
    optim: int
    master: int = 0
    notes: list[str] = field(default_factory=list)


def _moments_bytes(numel: int, b: StateBytesPerElement, precision) -> int:
    """AdamW's two moments for one tensor of `numel` (local) elements.

    With `optimizer_8bit` (torchao's AdamW8bit) a tensor of at least 4096 elements divisible by
    the 256-element block keeps each moment as uint8 codes, an fp32 scale per block and a
    256-entry fp32 lookup table; smaller tensors keep plain moments in the parameter dtype.
    """
    if getattr(precision, "optimizer_8bit", False) and numel >= 4096 and numel % 256 == 0:
        return 2 * (numel + 4 * (numel // 256) + 4 * 256)
    return numel * b.optim


def _fsdp_rows(dim0: int, shard: int, shard_rank: int) -> tuple[int, int]:
    """(padded rows, real rows) of one rank's dim-0 shard: FSDP2 pads dim 0 to a multiple of
    the shard group; the storage holds the padded chunk, the optimizer state only real rows."""
    chunk = -(-dim0 // shard)
    real = max(0, min(chunk, dim0 - shard_rank * chunk))
    return chunk, real


def model_state_bytes(shapes: list[tuple[int, ...]], setup: MemorySetup) -> ModelState:
    """Params, grads, optimizer states and master copy held by `setup.rank`, laid out as the
    strategy lays them out."""
    s, n, notes = setup.strategy, setup.world_size, []
    b = state_bytes_per_element(setup.precision, deepspeed=s.startswith("zero"))
    total = sum(_numel(sh) for sh in shapes)
    steps = len(shapes) * b.step
    if s in ("single", "ddp"):
        # DDP's gradients are views into its buckets (gradient_as_bucket_view): one copy.
        moments = sum(_moments_bytes(_numel(sh), b, setup.precision) for sh in shapes)
        return ModelState(total * b.param, total * b.grad, moments + steps, total * b.master, notes)
    if s == "fsdp":
        shard = n // max(1, setup.replicate_degree)
        r = setup.rank % shard
        padded = real = moments = 0
        for sh in shapes:
            rest = _numel(sh[1:])
            chunk, rows = _fsdp_rows(sh[0], shard, r)
            padded += chunk * rest
            real += rows * rest
            moments += _moments_bytes(rows * rest, b, setup.precision)
        if padded != real:
            notes.append(f"FSDP pads dim 0 of each tensor to a multiple of {shard}")
        # Params and the reduce-scattered grads keep the padded chunk; AdamW's states are
        # zeros_like the unpadded local view.
        return ModelState(
            padded * b.param, padded * b.grad, moments + steps, real * b.master, notes
        )
    groups = _decay_groups(shapes)  # DeepSpeed flattens each of AdamW's param groups
    ds_steps = len([g for g in groups if g]) * b.step
    if s in ("zero1", "zero2"):
        zp = zero_partition(shapes, setup)
        grads = zp.overlap_elements
        if s == "zero1":
            grads = zero1_grad_elements(zp, total, setup)
            if zero1_holds_full_grads(setup):
                notes.append(
                    "ZeRO-1 holds the full gradients until the accumulation boundary "
                    "(gradient accumulation, or no overlap_comm off CUDA)"
                )
        return ModelState(
            total * b.param,
            grads * b.grad,
            zp.elements * b.optim + ds_steps,
            zp.elements * b.master,
            notes,
        )
    if s == "zero3":
        part = sum(-(-_numel(sh) // n) for sh in shapes)  # each tensor partitioned, padded
        return ModelState(
            part * b.param, part * b.grad, part * b.optim + ds_steps, part * b.master, notes
        )
    raise ValueError(f"unknown strategy {s!r}; known: {', '.join(STRATEGY_NAMES)}")


@dataclass(frozen=True)
class ZeroPartition:
    """How DeepSpeed's stage 1/2 optimizer splits the model for one rank.

    Each of AdamW's param groups is flattened, padded to a multiple of 2·N elements
    (nccl_start_alignment_factor = 2) and cut into N equal partitions; this rank owns one per
    group. Its gradient buffer (`grads_in_partition`) holds every parameter that overlaps its
    partitions, whole."""

    group_elements: tuple[int, ...]  # this rank's partition of each flat group (padded)
    overlap_elements: int  # the parameters overlapping those partitions, whole
    outside_sizes: tuple[int, ...]  # sizes of the parameters that do not overlap them

    @property
    def elements(self) -> int:
        return sum(self.group_elements)


def zero_partition(shapes: list[tuple[int, ...]], setup: MemorySetup) -> ZeroPartition:
    n, r = setup.world_size, setup.rank % setup.world_size
    parts, overlap, outside = [], 0, []
    for sizes in _decay_group_sizes(shapes):
        p_size = -(-sum(sizes) // (2 * n)) * 2
        parts.append(p_size)
        lo, hi, offset = r * p_size, (r + 1) * p_size, 0
        for k in sizes:
            if offset < hi and offset + k > lo:
                overlap += k
            else:
                outside.append(k)
            offset += k
    return ZeroPartition(tuple(parts), overlap, tuple(outside))


def ds_overlap_comm(setup: MemorySetup) -> bool:
    """Whether DeepSpeed reduces gradients during the backward (overlap_comm)."""
    if setup.ds_overlap_comm is not None:
        return setup.ds_overlap_comm
    return setup.device == "cuda"


def zero1_holds_full_grads(setup: MemorySetup) -> bool:
    """True where a ZeRO-1 rank holds every gradient at once (see zero1_grad_elements)."""
    return not ds_overlap_comm(setup) or setup.grad_accum_steps > 1


def zero1_grad_elements(zp: ZeroPartition, total: int, setup: MemorySetup) -> int:
    """Gradient elements a ZeRO-1 rank holds at its peak (DeepSpeed 0.19's
    runtime/zero/stage_1_and_2.py, checked on 2 CPU ranks), in the module's dtype: 2 bytes
    under bf16 (DeepSpeed casts the module), 4 under fp32.

    ZeRO-1 reduces only at the accumulation boundary. There it moves each p.grad into a
    reduce bucket (p.grad then points into the bucket, the gradient's own storage is freed),
    reduces the bucket, and copies the gradients of the parameters overlapping this rank's
    partition, whole, into `grads_in_partition` (`zp.overlap_elements`, a little over Ψ/N:
    what ZeRO-2 keeps too). At the end of the backward the rest is dropped; the optimizer
    step flattens that buffer group by group and frees it. So:

    * **full gradients, Ψ** (the ZeRO paper's 2Ψ bytes at 16 bits), wherever the reduction
      does not run during the backward: always with gradient accumulation
      (grad_accum_steps > 1: the micro-steps before the last one accumulate autograd's
      p.grad, on CUDA too, and those gradients are alive beside the last micro-batch's
      activations), and on every step without overlap_comm (dtrain on CPU), from the
      backward until the boundary reduction;
    * **the partition buffer only** with overlap_comm (dtrain on CUDA) and no accumulation:
      each gradient is copied into a reduce bucket the moment autograd produces it and its
      own storage freed, so beyond the buckets the rank holds only the partition buffer
      (with a bucket at least as large as the model, the whole gradient sits in the first
      bucket until the end of the backward). Parameters larger than a bucket bypass it;
      ZeRO-1 (unlike ZeRO-2) keeps those outside its partition whole until the end of the
      backward, and the last of them autograd produces is whole until reduced (none with
      dtrain's default 2000 MB buckets: 524M elements, more than any tensor of any preset).

    Not counted here: DeepSpeed's reduce buckets (`ds_reduce_bucket_bytes`), which hold
    gradients in flight and are communication workspace sized by bucket_cap_mb, not by the
    model; and the flat fp32 gradient partition the optimizer step builds for one param group
    at a time (`zero_step_copy_bytes`). plan_memory plans both as transients. Under ZeRO-1
    with overlap_comm the p.grad of parameters outside the partition stay views into the
    buckets after the reduction (ZeRO-2 drops them), so counting p.grad storages also counts
    both buckets: on the 1b model (bf16, 2x H200) that was the 3.2 GiB "gradients" per rank,
    the partition buffer (1.24 GiB on rank 0) plus 2 x 524,288,000 x 2 bytes of buckets.
    """
    if zero1_holds_full_grads(setup):
        return total
    big = sum(k for k in zp.outside_sizes if k > setup.ds_bucket_elements)
    return zp.overlap_elements + big


def ds_reduce_bucket_bytes(setup: MemorySetup) -> int:
    """DeepSpeed stage 1/2's reduce buckets: `torch.empty(reduce_bucket_size)` in the
    module's dtype at the first gradient hook of a step, two with overlap_comm (one filling
    while the other reduces), kept until the boundary reduction ends. Allocated at full size
    whatever the model's size."""
    b = state_bytes_per_element(setup.precision, deepspeed=True)
    return (2 if ds_overlap_comm(setup) else 1) * setup.ds_bucket_elements * b.grad


def zero_step_copy_bytes(zp: ZeroPartition, setup: MemorySetup) -> int:
    """The most the stage 1/2 optimizer step adds beside the partition buffer: for one param
    group at a time it flattens the gradients into a partition (module dtype) and converts
    it to fp32 for the fp32 master (the same tensor under fp32; under bf16 the 16-bit flat
    copy is freed right after the conversion)."""
    g = state_bytes_per_element(setup.precision, deepspeed=True).grad
    per_element = 4 + (g if g != 4 else 0)
    return max(zp.group_elements, default=0) * per_element


def _decay_group_sizes(shapes: list[tuple[int, ...]]) -> list[list[int]]:
    """Tensor sizes in AdamW's two parameter groups, in order (see dtrain.optim)."""
    return [
        [_numel(s) for s in shapes if len(s) >= 2],
        [_numel(s) for s in shapes if len(s) < 2],
    ]


def _decay_groups(shapes: list[tuple[int, ...]]) -> list[int]:
    """Elements in AdamW's two parameter groups (decayed matrices, undecayed vectors)."""
    return [
        sum(_numel(s) for s in shapes if len(s) >= 2),
        sum(_numel(s) for s in shapes if len(s) < 2),
    ]


# --- activations --------------------------------------------------------------------------


def uses_autocast(setup: MemorySetup) -> bool:
    """Mixed precision through autocast (single, DDP), which casts every matmul's inputs.

    FSDP's MixedPrecisionPolicy and DeepSpeed instead hand the module parameters already in
    the compute dtype, so activations are born in it and each one is kept once."""
    pr = setup.precision
    return pr.compute_dtype != pr.param_dtype and setup.strategy in ("single", "ddp")


def quantized_inputs(setup: MemorySetup) -> str:
    """'int8' or 'fp8' where the blocks' linears are swapped for quantized ones whose saved
    inputs differ from F.linear's (dtrain/lowp/int8.py, torchao Float8Linear); else ''.

    int8-torchao saves its inputs in the compute dtype, as F.linear does: ''."""
    q = getattr(setup.precision, "quantize", "")
    return q if q in ("int8", "fp8") else ""


def layer_activation_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Bytes one transformer block saves for backward, for one micro-batch.

    Eager (what dtrain/model.py does, tensor by tensor; a test checks this count against
    the tensors autograd really saves, on CPU, for fp32, bf16 and int8 under autocast and for
    bf16, int8 and fp8 computing natively in bf16 as under FSDP), with c = compute bytes,
    sbh = micro_batch · seq · d_model, bs = micro_batch · seq, f = ffn_hidden:
      each RMSNorm upcasts its input and keeps it in fp32 (4·sbh) with rstd (4·b·s); the
      composite CPU kernel also keeps x·rstd (4·sbh), CUDA's fused kernel does not; a gain
      stored in fewer than 4 bytes is upcast too, and that fp32 copy (4·h) is kept;
      wq, wk, wv keep their inputs: under autocast each casts the norm's output separately
      (3·c·sbh), in one dtype they share it (1·c·sbh); the same for w1, w3 (2 or 1);
      SDPA keeps q, k, v (k, v repeated to every head under GQA), its output and the fp32
      log-sum-exp (b·heads·s): no s x s scores, so Korthikanti's 5as/h term is gone; wo reads
      SDPA's output through a view on CUDA (flash's output is laid out (B, T, H, D)), a copy
      on CPU;
      SwiGLU keeps w1's output, silu's output, w3's output, and w2 its input (the product):
      4·c·b·s·f.
    int8 eager (dtrain/lowp/int8.py): each of the seven linears quantizes its own input and
      saves only that int8 copy (1 byte an element) and its fp32 per-token scales (4·b·s), so
      the five norm-fed linears keep 5·(sbh + 4·bs) in every setting, wo sbh + 4·bs instead
      of its input, w2 b·s·f + 4·bs instead of the c-byte product; the weights are the
      parameters themselves, so autocast caches no copy of them (`autocast_weight_bytes`).
    fp8 eager (torchao's Float8Linear): `matmul_with_hp_or_float8_args` saves its input and
      weight in high precision and casts them to fp8 again in backward, so the block saves what
      bf16 saves; under autocast Float8Linear casts its input to the autocast dtype itself
      (on CUDA: torch.is_autocast_enabled() is CUDA's), while the weight reaches the fp8 cast
      uncast: no autocast weight cache for the blocks either.
    Compiled (inductor's min-cut partitioner, per block; checked tensor by tensor against the
    saved tensors of a compiled block on CPU, tests/test_memory.py, marked slow): each norm
    keeps its input in the residual dtype and rstd; SDPA keeps q, out, un-repeated k, v and
    the log-sum-exp; SwiGLU keeps w1's and w3's outputs. What a matmul's backward reads is
    materialised in forward and saved, since recomputing it would not fuse into the matmul:
    the c-cast outputs of the two norms (shared by wq, wk, wv and by w1, w3, after CSE), wo's
    contiguous input and w2's input (the product): 3·c·sbh + c·b·s·f.
    Compiled, quantized: none of those matmul inputs is saved. The quantized operand is a
    pointwise function of tensors saved anyway (the norm's input and rstd, SDPA's output, w1's
    and w3's outputs) and of its scale, so the partitioner recomputes it in backward; only the
    scales, reductions it will not recompute, are saved: int8 one fp32 scale per token for
    each of the four distinct inputs (4 x 4·bs); fp8 tensorwise one 0-d amax (c bytes) per
    linear; fp8 rowwise nothing (its row-wise scales are recomputed with the casts).
    This matches the GPU (model=1b, fsdp x2, micro-batch 8 x 2048, compiled blocks, H200):
    measured peak allocated bf16 minus int8 is 8.619 GiB per rank, and 24 layers x
    (3·c·sbh + c·b·s·f - 4 x 4·bs) is 8.619 GiB. The plans for those runs (plan_memory, rank 0,
    vocab 50304) are +2.0% (bf16), -3.0% (int8) and -2.7% (fp8) off the measured peak reserved
    (42.82, 35.24, 35.01 GiB); no constant was fitted to them.
    """
    pr = setup.precision
    c = _itemsize(pr.compute_dtype)
    mixed = uses_autocast(setup)
    quant = quantized_inputs(setup)
    b, s, h, f = setup.micro_batch_size, setup.seq_len, cfg.d_model, cfg.ffn_hidden
    bs, sbh, bsf = b * s, b * s * h, b * s * f
    kv = b * s * cfg.n_kv_head * cfg.head_dim
    lse = 4 * b * cfg.n_head * s
    # The residual stream has the embedding's dtype: the stored one under autocast (which
    # leaves embeddings alone), the compute dtype where the module computes in it natively.
    native = setup.strategy not in ("single", "ddp")
    r = c if native else _itemsize(pr.param_dtype)
    resid = r * sbh
    if setup.activation_checkpointing == "full":
        return resid  # only the block's input; the rest is recomputed in backward
    if setup.activation_checkpointing == "selective":
        # torchtitan's op-level policy: keep matmul and attention outputs, recompute the rest.
        mm_out = c * (sbh + 2 * kv) + c * sbh + 2 * c * b * s * f + c * sbh  # q,k,v wo w1,w3 w2
        return resid + mm_out + c * sbh + lse  # + block input, SDPA out, lse
    if setup.compile:
        norms = 2 * (resid + 4 * bs)  # each norm's input (the residual) and rstd
        attn = c * sbh + 2 * c * kv + c * sbh + lse
        mlp = 2 * c * bsf
        if quant == "int8":
            mm_inputs = 4 * 4 * bs  # per-token scales of qkv's, wo's, w1/w3's, w2's input
        elif quant == "fp8" and getattr(pr, "fp8_recipe", "tensorwise") == "rowwise":
            mm_inputs = 0  # the row-wise scales are recomputed with the casts
        elif quant == "fp8":
            mm_inputs = 7 * c  # one 0-d amax per linear, in the input's dtype
        else:
            mm_inputs = 2 * c * sbh + c * sbh + c * bsf
        return norms + attn + mlp + mm_inputs
    fused_norm = setup.device == "cuda"
    gain = 4 * h if r < 4 else 0  # RMSNorm's weight.float(): a copy where the gain is narrower
    norms = 2 * (4 * sbh + 4 * bs + (0 if fused_norm else 4 * sbh) + gain)
    attn = 4 * c * sbh + lse
    mlp = 3 * c * bsf
    if quant == "int8":
        linear_inputs = 6 * (sbh + 4 * bs) + bsf + 4 * bs  # int8 copies + per-token scales
    else:
        linear_inputs = (3 + 2) * c * sbh if mixed else 2 * c * sbh
        linear_inputs += (0 if setup.device == "cuda" else c * sbh) + c * bsf  # wo's, w2's
    return norms + attn + mlp + linear_inputs


def autocast_weight_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Autocast's cached casts of the weight matrices (c bytes each), kept for backward.

    Only where autocast does the casting (single, DDP); FSDP all-gathers in the compute dtype
    and DeepSpeed casts the module itself. Inductor recomputes the casts in backward. The
    blocks' int8 and fp8 linears hand autocast no weight to cast (their matmuls are not F.linear):
    only the output layer's is cached."""
    pr = setup.precision
    if not uses_autocast(setup) or setup.compile:
        return 0
    d, hd = cfg.d_model, cfg.head_dim
    per_layer = 2 * d * cfg.n_head * hd + 2 * d * cfg.n_kv_head * hd + 3 * d * cfg.ffn_hidden
    if quantized_inputs(setup):
        per_layer = 0
    return _itemsize(pr.compute_dtype) * (cfg.n_layer * per_layer + cfg.vocab_size * d)


def head_activation_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Embedding + final norm + output layer + loss, saved for backward: the token ids and
    targets (int64), the norm's fp32 input and rstd (and x·rstd off CUDA), the output layer's
    input and the fp32 log-softmax over the vocabulary (compiled: the logits in c bytes)."""
    c = _itemsize(setup.precision.compute_dtype)
    bs = setup.micro_batch_size * setup.seq_len
    bsd = bs * cfg.d_model
    ids = 2 * 8 * bs
    norm = 4 * bsd + 4 * bs + (0 if setup.device == "cuda" or setup.compile else 4 * bsd)
    native = setup.strategy not in ("single", "ddp")
    if native and c < 4 and not setup.compile:
        norm += 4 * cfg.d_model  # the fp32 copy of a c-byte gain (see layer_activation_bytes)
    out_in = c * bsd
    # Eager: nll_loss also keeps its 0-d fp32 total weight.
    loss = (c * bs * cfg.vocab_size + 4 * bs) if setup.compile else 4 * bs * cfg.vocab_size + 4
    return ids + norm + out_in + loss


def loss_transient_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Extra bytes at the start of backward: the loss's gradient w.r.t. the fp32 log-softmax
    and w.r.t. its input (eager: 2 x 4 bytes per logit; the c-bytes logits cast back after); in
    the forward, the c-bytes logits and their fp32 copy were alive at once.

    Compiled (dtrain.model.lm_loss under torch.compile), the backward is one fused kernel that
    writes the gradient w.r.t. the logits in their own dtype from the saved logits and one
    logsumexp per token: c bytes per logit. Checked in Inductor's generated code for bf16
    logits (its backward allocates one bf16 buffer of the logits' shape and a row vector), and
    against the GPU: with this term the 1b fsdp plan before allocator slack is within 1% of the
    measured peak allocated for bf16 and int8 (2x H200, docs/benchmarks.md)."""
    c = _itemsize(setup.precision.compute_dtype)
    mixed = setup.precision.compute_dtype != setup.precision.param_dtype
    logits = setup.micro_batch_size * setup.seq_len * cfg.vocab_size
    if setup.compile:
        return c * logits
    return max(8, c + (4 if mixed else 0)) * logits


# --- putting it together ------------------------------------------------------------------


def _block_numel(cfg: ModelConfig) -> int:
    hd = cfg.head_dim
    return (
        2 * cfg.d_model * cfg.n_head * hd
        + 2 * cfg.d_model * cfg.n_kv_head * hd
        + (3 * cfg.d_model * cfg.ffn_hidden + 2 * cfg.d_model)
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


# --- compute budget -------------------------------------------------------------------------


def gpu_peak_flops(gpu: GpuSpec, precision) -> float:
    """Dense peak for the precision's compute dtype: the 16-bit rate for bf16/fp16 and for the
    quantized precisions too (int8/fp8 linears run on 8-bit tensor cores, but attention and the
    head stay 16-bit, and one denominator keeps MFU comparable across precisions, as the
    speed-ups in docs/benchmarks.md are); fp32 runs on TF32 tensor cores only where allowed."""
    if _itemsize(precision.compute_dtype) <= 2:
        return gpu.bf16_flops
    return gpu.tf32_flops if getattr(precision, "tf32", False) else gpu.fp32_flops


@dataclass
class ComputeBudget:
    n_params: int
    flops_per_token: float
    chinchilla_tokens: int  # ~20 tokens per parameter (Hoffmann et al. 2022)
    tokens: int  # the run's tokens (its own length, or Chinchilla's when asked)
    total_flops: float
    petaflop_s_days: float
    gpu_hours: float | None  # at `mfu` of `peak_flops` per GPU
    wall_hours: float | None  # gpu_hours / world_size
    mfu: float
    peak_flops: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def compute_budget(
    cfg: ModelConfig,
    seq_len: int,
    tokens: int | None,
    *,
    world_size: int = 1,
    peak_flops: float | None = None,
    mfu: float = 0.4,
) -> ComputeBudget:
    """FLOPs for `tokens` (None: Chinchilla-optimal, 20 per parameter), in petaFLOP/s-days and
    GPU-hours at a stated MFU."""
    n = count_params(cfg)
    fpt = flops_per_token(cfg, seq_len)
    chinchilla = 20 * n
    tokens = chinchilla if tokens is None else tokens
    total = fpt * tokens
    gpu_hours = total / (peak_flops * mfu) / 3600 if peak_flops else None
    return ComputeBudget(
        n_params=n,
        flops_per_token=fpt,
        chinchilla_tokens=chinchilla,
        tokens=tokens,
        total_flops=total,
        petaflop_s_days=total / (1e15 * 86400),
        gpu_hours=gpu_hours,
        wall_hours=gpu_hours / world_size if gpu_hours is not None else None,
        mfu=mfu,
        peak_flops=peak_flops,
    )


# --- from a TrainConfig -------------------------------------------------------------------


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


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def summary_text(plan: MemoryPlan, setup: MemorySetup, cfg: ModelConfig) -> str:
    """A few sentences: where the memory goes, and the rule of thumb against this breakdown."""
    n = plan.n_params
    parts = {
        "parameters": plan.params_bytes,
        "gradients": plan.grads_bytes,
        "optimizer states": plan.optim_bytes,
        "activations": plan.activations_bytes,
        "transient buffers": plan.transient_bytes,
    }
    biggest = max(parts, key=parts.get)
    per_param = plan.model_state_bytes / n if n else 0.0
    full_state = 16 * n  # 4 (fp32 weight) + 4 (grad) + 8 (Adam moments): the 1B -> ~16 GB part
    thumb = 24 * n  # "24 GB per 1B parameters at fp32": ~4 bytes of weights + 20 extra
    lines = [
        f"{setup.strategy} x {setup.precision.name} on {setup.world_size} rank(s), "
        f"{cfg.name} ({n / 1e6:.1f}M params), micro-batch {setup.micro_batch_size} x "
        f"{setup.seq_len} tokens: predicted peak {fmt_bytes(plan.total_bytes)} per GPU "
        f"({plan.phase} is the peak moment).",
        f"The largest part is {biggest} ({fmt_bytes(parts[biggest])}); model state is "
        f"{fmt_bytes(plan.model_state_bytes)} = {per_param:.1f} bytes per parameter per GPU, "
        f"activations and buffers {fmt_bytes(plan.activations_bytes + plan.transient_bytes)}.",
        f"Rule of thumb: ~20 extra bytes per parameter on top of the weights, 24 GB per 1B "
        f"parameters at fp32, gives {fmt_bytes(thumb)} for this model; unsharded fp32 AdamW "
        f"state is really 16 bytes per parameter ({fmt_bytes(full_state)}), and the rest of "
        f"the rule is an allowance for activations, which here are "
        f"{fmt_bytes(plan.activations_bytes + plan.transient_bytes)} and grow with "
        f"micro-batch x sequence, not with parameters.",
    ]
    if setup.world_size > 1 and setup.strategy not in ("single", "ddp"):
        lines.append(
            f"Sharding over {setup.world_size} ranks cuts model state to {per_param:.1f} "
            f"bytes per parameter per GPU (16 unsharded)."
        )
    lines += plan.notes
    return " ".join(lines)


# --- in a training run --------------------------------------------------------------------

# TensorBoard custom-scalars layout: one chart per quantity with every rank's (and, with
# --logdir at the parent of several run dirs, every run's) curves overlaid.
TB_LAYOUT = {
    "memory": {
        "peak reserved per rank (CUDA)": [
            "Multiline",
            [r"memory/rank\d+/peak_reserved_bytes", r"memory/predicted/peak_reserved_bytes"],
        ],
        "peak RSS per rank (CPU)": ["Multiline", [r"memory/rank\d+/peak_rss_bytes"]],
        "model state per rank": [
            "Multiline",
            [r"memory/rank\d+/(params|grads|optim)_bytes", r"memory/predicted/model_state_bytes"],
        ],
        "predicted breakdown": ["Multiline", [r"memory/predicted/.*"]],
        "prediction error %": ["Multiline", [r"memory/prediction_error_pct"]],
        "prediction error % (model state, CPU)": [
            "Multiline",
            [r"memory/prediction_error_pct_model_state"],
        ],
    },
    "throughput": {
        "tokens/s per GPU": ["Multiline", [r"perf/tokens_per_s_per_gpu"]],
        "MFU": ["Multiline", [r"perf/mfu"]],
        "loss": ["Multiline", [r"train/loss", r"eval/loss"]],
    },
}


def run_prediction(cfg, precision, env, compile_enabled: bool) -> tuple[MemoryPlan, MemorySetup]:
    """The plan for rank 0 of this run (the rank that holds the most under FSDP padding)."""
    setup = setup_from_config(cfg, precision, env.world_size, device=env.device.type)
    setup = replace(setup, compile=compile_enabled)
    return plan_memory(cfg.model, setup), setup


def predicted_record(plan: MemoryPlan) -> dict:
    """The `memory_predicted` object of metrics.jsonl."""
    keys = (
        "params_bytes",
        "grads_bytes",
        "optim_bytes",
        "activations_bytes",
        "transient_bytes",
        "overhead_bytes",
        "context_bytes",
        "peak_bytes",
        "host_bytes",
        "master_bytes",
    )
    out = {k: getattr(plan, k) for k in keys}
    out["total_bytes"] = plan.total_bytes
    out["model_state_bytes"] = plan.model_state_bytes
    out["phase"] = plan.phase
    out["at_peak"] = dict(plan.at_peak)
    return out


def predicted_scalars(plan: MemoryPlan) -> dict:
    rec = predicted_record(plan)
    out = {f"memory/predicted/{k}": v for k, v in rec.items() if isinstance(v, int)}
    out["memory/predicted/peak_reserved_bytes"] = plan.peak_bytes
    for part, v in plan.at_peak.items():  # what is alive at the peak, for charts
        out[f"memory/predicted/at_peak_{part}"] = v
    return out


# What prediction_error_pct compared -> (TensorBoard tag, words for the console): a CPU
# model-state error is not a GPU peak error, so it never shares the peak's chart.
PREDICTION_COMPARES = {
    "peak_reserved": ("memory/prediction_error_pct", "peak reserved, CUDA"),
    "model_state": ("memory/prediction_error_pct_model_state", "model state only, CPU"),
}


def prediction_error_pct(plan: MemoryPlan, memory_per_rank: list[dict]) -> tuple[float, str]:
    """(error %, what was compared) against the worst rank.

    On CUDA: predicted peak reserved vs the largest measured `peak_reserved_bytes`. Elsewhere
    (CPU: RSS holds Python, the data and torch itself, nothing a GPU plan describes): predicted
    model-state bytes vs the largest measured params + grads + optimizer bytes.
    """
    if all("peak_reserved_bytes" in m for m in memory_per_rank):
        measured = max(m["peak_reserved_bytes"] for m in memory_per_rank)
        predicted, what = plan.peak_bytes, "peak_reserved"
    else:
        measured = max(
            sum(m.get(k, 0) for k in ("params_bytes", "grads_bytes", "optim_bytes", "master_bytes"))
            for m in memory_per_rank
        )
        predicted, what = plan.model_state_bytes, "model_state"
    if measured <= 0:
        return float("nan"), what
    return 100.0 * (predicted - measured) / measured, what


def markdown_breakdown(plan: MemoryPlan, text: str) -> str:
    """The TensorBoard text summary: a table of the prediction and the sentences."""
    rows = [
        ("parameters", plan.params_bytes),
        ("gradients", plan.grads_bytes),
        ("optimizer states", plan.optim_bytes),
        ("activations", plan.activations_bytes),
        ("transient buffers", plan.transient_bytes),
        ("overhead (allocator + CUDA context)", plan.overhead_bytes),
        (f"**peak per GPU** ({plan.phase})", plan.total_bytes),
    ]
    table = "| part | predicted |\n|---|---|\n" + "\n".join(
        f"| {k} | {fmt_bytes(v)} |" for k, v in rows
    )
    return table + "\n\n" + text
