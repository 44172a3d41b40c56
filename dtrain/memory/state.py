"""Model state per rank: params, grads, optimizer states and master copy, laid out as each
strategy stores them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dtrain.memory.setup import STRATEGY_NAMES, MemorySetup
from dtrain.model import ModelConfig


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
