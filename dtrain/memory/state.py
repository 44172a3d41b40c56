"""Model state per rank: params, grads, optimizer states and master copy, laid out as the
strategy declares it holds them (MemoryFacts.shards, .partition). Exact to the byte."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dtrain.memory.setup import MemorySetup
from dtrain.model import ModelConfig


def param_shapes(cfg: ModelConfig, tp: int = 1) -> list[tuple[int, ...]]:
    """Shapes of the model's parameter tensors in `GPT.parameters()` order (tied ones once),
    as one rank of `tp` tensor-parallel ranks holds them (dtrain/parallel/tensor.py's plan:
    heads, hidden units and vocabulary split, norms whole).

    Written from dtrain/model.py's constructors rather than by building the model on the meta
    device (seconds for large presets, repeated by the micro-batch search); a test checks the
    two agree.
    """
    d, hd = cfg.d_model, cfg.head_dim
    f, q, kv, vocab = (
        -(-n // tp) for n in (cfg.ffn_hidden, cfg.n_head, cfg.n_kv_head, cfg.vocab_size)
    )
    block = [
        (d,),  # attn_norm
        (q * hd, d),  # wq
        (kv * hd, d),  # wk
        (kv * hd, d),  # wv
        (d, q * hd),  # wo
        (d,),  # ffn_norm
        (f, d),  # w1
        (f, d),  # w3
        (d, f),  # w2
    ]
    shapes = [(vocab, d)] + block * cfg.n_layer + [(d,)]
    if not cfg.tie_embeddings:
        shapes.append((vocab, d))
    return shapes


@dataclass(frozen=True)
class StateBytesPerElement:
    """Bytes per parameter element of each kind of model state, from a Precision's fields."""

    param: int  # the parameter tensor the model computes with or shards
    grad: int
    optim: int  # the optimizer's states: AdamW's two moments
    master: int = 0  # a master copy of the weights kept apart from the parameters
    step: int = 4  # the 0-d fp32 `step` tensor, per parameter tensor (or flat group)


def state_bytes_per_element(precision, fp32_master: bool = False) -> StateBytesPerElement:
    """torch AdamW keeps its moments in `optim_dtype` beside the parameters. With an
    `fp32_master` partition (DeepSpeed's ZeRO optimizers, even in fp32) the module itself is
    cast to a 16-bit compute dtype: ZeRO's 2 + 2 + 12 bytes."""
    p = precision.param_dtype.itemsize
    o = precision.optim_dtype.itemsize
    if fp32_master:
        w = precision.compute_dtype.itemsize if precision.mixed else p
        return StateBytesPerElement(param=w, grad=w, optim=2 * o, master=4)
    return StateBytesPerElement(param=p, grad=p, optim=2 * o)


@dataclass
class ModelState:
    """Bytes of model state one rank holds."""

    params: int
    grads: int
    optim: int
    master: int = 0
    notes: list[str] = field(default_factory=list)


def model_state_bytes(shapes: list[tuple[int, ...]], setup: MemorySetup) -> ModelState:
    """Params, grads, optimizer states and master copy held by `setup.rank`."""
    facts = setup.facts
    b = state_bytes_per_element(setup.precision, fp32_master=facts.fp32_master)
    if facts.partition == "dim0":
        return _dim0_shards(shapes, setup, b)
    if facts.partition in ("flat", "groups"):
        return _zero_partitions(shapes, setup, b)
    # Whole on every rank; DDP's gradients are views into its buckets: one copy.
    total = sum(math.prod(sh) for sh in shapes)
    moments = sum(_moments_bytes(math.prod(sh), b, setup.precision) for sh in shapes)
    return ModelState(total * b.param, total * b.grad, moments + len(shapes) * b.step)


def _moments_bytes(numel: int, b: StateBytesPerElement, precision) -> int:
    """AdamW's two moments for one tensor of `numel` (local) elements. torchao's AdamW8bit
    (`optimizer_8bit`) quantizes a tensor of 4096+ elements in 256-element blocks: uint8
    codes, an fp32 scale per block and a 256-entry fp32 lookup table per moment."""
    if getattr(precision, "optimizer_8bit", False) and numel >= 4096 and numel % 256 == 0:
        return 2 * (numel + 4 * (numel // 256) + 4 * 256)
    return numel * b.optim


def _dim0_shards(shapes, setup: MemorySetup, b: StateBytesPerElement) -> ModelState:
    """FSDP2: dim 0 of each tensor padded to a multiple of the shard group and cut in chunks;
    params and the reduce-scattered grads keep the padded chunk, AdamW's states (zeros_like
    the local view) only its real rows, so the last ranks may hold less."""
    shard = setup.world_size // (max(1, setup.replicate_degree) * setup.tp)  # dp x cp
    r = (setup.rank // setup.tp) % shard
    padded = real = moments = 0
    for sh in shapes:
        rest = math.prod(sh[1:])
        chunk = -(-sh[0] // shard)
        rows = max(0, min(chunk, sh[0] - r * chunk))
        padded += chunk * rest
        real += rows * rest
        moments += _moments_bytes(rows * rest, b, setup.precision)
    notes = [f"FSDP pads dim 0 of each tensor to a multiple of {shard}"] if padded != real else []
    return ModelState(padded * b.param, padded * b.grad, moments + len(shapes) * b.step, 0, notes)


def _zero_partitions(shapes, setup: MemorySetup, b: StateBytesPerElement) -> ModelState:
    """DeepSpeed's ZeRO: the optimizer steps flat fp32 partitions, one per param group."""
    facts, notes = setup.facts, []
    steps = sum(1 for g in _decay_group_sizes(shapes) if sum(g)) * b.step
    if facts.partition == "flat":  # ZeRO-3: each tensor partitioned, padded
        part = sum(-(-math.prod(sh) // setup.world_size) for sh in shapes)
        return ModelState(part * b.param, part * b.grad, part * b.optim + steps, part * b.master)
    zp = zero_partition(shapes, setup)
    grads = zp.overlap_elements
    if "grads" not in facts.shards:
        total = sum(math.prod(sh) for sh in shapes)
        grads = zero1_grad_elements(zp, total, setup)
        if zero1_holds_full_grads(setup):
            notes.append(
                "ZeRO-1 holds the full gradients until the accumulation boundary "
                "(gradient accumulation, or no overlap_comm off CUDA)"
            )
    params = sum(math.prod(sh) for sh in shapes) * b.param
    optim = zp.elements * b.optim + steps
    return ModelState(params, grads * b.grad, optim, zp.elements * b.master, notes)


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
    """Gradient elements a ZeRO-1 rank holds at its peak, in the module's dtype (DeepSpeed
    0.19's stage_1_and_2.py; docs/memory.md, "What ZeRO-1 holds"). ZeRO-1 reduces only at the
    accumulation boundary, so it holds the full gradients wherever they wait for it (with
    accumulation, or without overlap_comm); else, as ZeRO-2, the parameters overlapping its
    partition, plus those outside it too large for a bucket. The reduce buckets and the
    step's flat fp32 copy are planned apart, as transients."""
    if zero1_holds_full_grads(setup):
        return total
    big = sum(k for k in zp.outside_sizes if k > setup.ds_bucket_elements)
    return zp.overlap_elements + big


def ds_reduce_bucket_bytes(setup: MemorySetup) -> int:
    """DeepSpeed stage 1/2's reduce buckets, in the module's dtype and at full size whatever
    the model: two with overlap_comm (one filling while the other reduces), else one."""
    b = state_bytes_per_element(setup.precision, fp32_master=True)
    return (2 if ds_overlap_comm(setup) else 1) * setup.ds_bucket_elements * b.grad


def zero_step_copy_bytes(zp: ZeroPartition, setup: MemorySetup) -> int:
    """The most the stage 1/2 optimizer step adds beside the partition buffer: one param
    group's gradients flattened (module dtype) and converted to fp32 for the master (one
    tensor under fp32)."""
    g = state_bytes_per_element(setup.precision, fp32_master=True).grad
    per_element = 4 + (g if g != 4 else 0)
    return max(zp.group_elements, default=0) * per_element


def _decay_group_sizes(shapes: list[tuple[int, ...]]) -> list[list[int]]:
    """Tensor sizes in AdamW's two parameter groups, decayed matrices then undecayed vectors
    (dtrain.optim.param_groups)."""
    return [
        [math.prod(s) for s in shapes if len(s) >= 2],
        [math.prod(s) for s in shapes if len(s) < 2],
    ]
