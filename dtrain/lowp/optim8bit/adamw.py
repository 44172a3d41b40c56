"""AdamW with 8-bit moments (torchao.optim.AdamW8bit): 2 bytes of optimizer state per parameter
instead of 8, block-wise (256) scaled. torchao's works with FSDP2's DTensors (bitsandbytes' does
not). Tensors under 4096 elements keep fp32 moments (torchao's rule: too small to matter).

dtrain steps it in a few compiled calls instead of torchao's one per tensor (GroupedAdamW8bit):
the same states, arithmetic and checkpoints, less host time. On CUDA each fp32 parameter whose
two moments are 8-bit is stepped by one Triton kernel instead (dtrain/lowp/optim8bit/triton_step.py:
the blocks in registers, 16 bytes moved a parameter against Inductor's 32; at 8b's shapes
32.1 ms a step against the compiled path's 41.3 ms, docs/benchmarks.md)."""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import nn

from dtrain.config import OptimConfig
from dtrain.errors import ConfigError
from dtrain.optim import param_groups

# At most this many tensors in one compiled call: a graph's size (and its compile time) grows
# with it, the host time saved does not once calls are few.
GROUP_TENSORS = 32
# And at most this many elements (unless one tensor has more): a graph may hold each of its
# tensors' fp32 moments at once before it quantizes them, 8 bytes an element; 2^26 bounds
# that near 0.5 GiB (torchao's per-tensor step holds one tensor's).
GROUP_ELEMENTS = 1 << 26


def build_adamw8bit(
    model: nn.Module, cfg: OptimConfig, *, compiled: bool = True
) -> torch.optim.Optimizer:
    """`compiled`: each group's step one compiled call, as torchao compiles its own (on every
    device); false: eager, torchao's bits op for op (tests)."""
    if cfg.name != "adamw":
        raise ConfigError(
            f"precision.optimizer_8bit=true needs optim=adamw (8-bit AdamW), got {cfg.name!r}"
        )
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        raise ConfigError(
            "precision.optimizer_8bit=true needs torchao, which is not installed: "
            "pip install torchao"
        ) from None
    # bf16 parameters (bf16-true) round their updates stochastically, so that updates below
    # bf16's resolution are kept on average instead of always lost.
    bf16_params = any(p.dtype == torch.bfloat16 for p in model.parameters())
    return grouped_adamw8bit_class()(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        bf16_stochastic_round=bf16_params,
        compiled=compiled,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard (FSDP2), the tensor itself otherwise: in place on it is in place on t.
    A shard that is torchao's fp8 all-gather weight (WeightWithDynamicFloat8CastTensor, under
    fsdp with precision=fp8) gives the plain tensor it wraps, so the compiled step sees no
    subclass: the graphs are those tested against torchao's (on the CPU Dynamo also traces the
    wrapper, with right results, but that path never ran on a GPU)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    inner = getattr(t, "_tensor", None)
    return inner if type(t) is not torch.Tensor and isinstance(inner, torch.Tensor) else t


def _state_parts(state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A moment as plain tensors: (codes, scale, qmap) for torchao's 8-bit state, (tensor,)
    for a plain one (tensors under 4096 elements)."""
    state = _local(state)
    codes = getattr(state, "codes", None)
    return (codes, state.scale, state.qmap) if codes is not None else (state,)


def _moment(parts: tuple[torch.Tensor, ...], target: torch.Tensor, weight: float):
    """torchao's `state.float().lerp(target, weight)` then `state.copy_(...)`, on the plain
    tensors: the fp32 moment, which the update uses before it is quantized again."""
    from torchao.optim.quant_utils import dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor

    if len(parts) == 1:
        (t,) = parts
        new = t.float().lerp(target, weight)
        t.copy_(new)
        return new
    codes, scale, qmap = parts
    new = dequant_with_qmap(codes, qmap, scale).lerp(target, weight)
    scaled, new_scale = scale_tensor(new, codes.numel() // scale.numel())
    codes.copy_(quantize_8bit_with_qmap(scaled, qmap))
    scale.copy_(new_scale)
    return new


def _adamw_tensors(items, lr, beta1: float, beta2: float, weight_decay: float, eps: float, sr):
    """torchao's single_param_adam (AdamW, no amsgrad) for each (param, grad, step, exp_avg
    parts, exp_avg_sq parts) of `items`, op for op, so eager it gives torchao's bits."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    for p, grad, step, exp_avg, exp_avg_sq in items:
        p_f32 = p.float()
        grad_f32 = grad.float()
        p_f32 = p_f32 - lr * weight_decay * p_f32
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        exp_avg_f32 = _moment(exp_avg, grad_f32, 1 - beta1)
        exp_avg_sq_f32 = _moment(exp_avg_sq, grad_f32.square(), 1 - beta2)
        denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
        p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
        p.copy_(_fp32_to_bf16_sr(p_f32) if sr and p.dtype is torch.bfloat16 else p_f32)


def _signature(item) -> tuple:
    p, grad, _, exp_avg, exp_avg_sq = item
    return (
        tuple(p.shape),
        p.dtype,
        grad.dtype,
        p.device,
        tuple(tuple(t.shape) for t in exp_avg),
        tuple(tuple(t.shape) for t in exp_avg_sq),
    )


def fused_kernel_takes(item) -> bool:
    """Whether the Triton kernel steps this (param, grad, step, exp_avg, exp_avg_sq): on CUDA
    (or in Triton's interpreter: the CPU test), an fp32 contiguous parameter with a gradient
    of its shape, both moments 8-bit in torchao's maps, the step count on the host (no sync to
    read it)."""
    p, grad, step, exp_avg, exp_avg_sq = item
    if not (p.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return (
        p.dtype == torch.float32
        and p.is_contiguous()
        and grad.shape == p.shape
        and grad.is_contiguous()
        and len(exp_avg) == len(exp_avg_sq) == 3
        and step.device.type == "cpu"
        and _torchaos_maps(exp_avg[2], exp_avg_sq[2])
    )


def _torchaos_maps(exp_avg_qmap: torch.Tensor, exp_avg_sq_qmap: torch.Tensor) -> bool:
    """Whether the moments use torchao's signed and unsigned dynamic maps, whose layout the
    kernel computes codes from (a sync each: read once, when the plan is made)."""
    signed, unsigned = _reference_maps()
    return torch.equal(exp_avg_qmap.cpu(), signed) and torch.equal(exp_avg_sq_qmap.cpu(), unsigned)


@functools.cache
def _reference_maps() -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's signed and unsigned maps as its states hold them, built once."""
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    return (
        torch.tensor(get_qmap_signed(), dtype=torch.float32),
        torch.tensor(get_qmap_unsigned(), dtype=torch.float32),
    )


def chunks_of_like_tensors(
    items: list, most: int = GROUP_TENSORS, elements: int = GROUP_ELEMENTS
) -> list[list]:
    """`items` grouped by shapes and dtypes (a compiled graph is specialised on them), each
    group cut into near-equal chunks of at most `most` tensors and `elements` elements (at
    least one tensor): few distinct graphs, few calls."""
    by_sig: dict[tuple, list] = {}
    for item in items:
        by_sig.setdefault(_signature(item), []).append(item)
    out = []
    for group in by_sig.values():
        per = min(most, max(1, elements // max(1, group[0][0].numel())))
        n = math.ceil(len(group) / per)
        q, r = divmod(len(group), n)  # r chunks of q + 1, then n - r of q
        start = 0
        for k in range(n):
            size = q + (k < r)
            out.append(group[start : start + size])
            start += size
    return out


def grouped_adamw8bit_class() -> type:
    """GroupedAdamW8bit, defined on first use: torchao is an extra, imported lazily."""
    global _GroupedAdamW8bit
    if _GroupedAdamW8bit is not None:
        return _GroupedAdamW8bit
    from torchao.optim import AdamW8bit

    class GroupedAdamW8bit(AdamW8bit):
        """torchao's AdamW8bit, stepped a group of like tensors per compiled call.

        torchao steps each tensor in a compiled call of its own. Under FSDP2 that held the host
        about 0.77 ms a tensor: model=8b int8 with 8-bit moments on 2x H200 ran at 16,290 tokens/s
        against 21,063 with fused AdamW, and at 1b the GPU sat idle 204 ms a step waiting for
        launches (dtrain/memory/speed.py; 21,063 is 8b's int8 row of docs/benchmarks.md,
        "Precision"). Here the DTensors and torchao's 8-bit states are unwrapped to their plain
        tensors first, and each group of tensors of one shape (chunks_of_like_tensors) is updated by
        one compiled call; on CUDA each fp32 tensor whose moments are both 8-bit is stepped by one
        Triton kernel instead (fused_kernel_takes, triton_step.py). The states, the arithmetic
        (torchao's own functions, op for op) and the state dict are torchao's, so checkpoints move
        between the two.
        """

        def __init__(self, *args, compiled: bool = True, **kwargs):
            super().__init__(*args, **kwargs)
            # Each param group's plan, found on the first step (shapes, dtypes and states are
            # fixed for the run): the positions, among the tensors with gradients, that the
            # Triton kernel steps, and the chunks of the rest, one compiled call each.
            self._chunks: dict[tuple, tuple[list[int], list[list[int]]]] = {}
            # Shapes are the model's, fixed for the run: one graph per group of like tensors.
            self._update = (
                torch.compile(_adamw_tensors, fullgraph=True, dynamic=False)
                if compiled
                else _adamw_tensors
            )

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for g, group in enumerate(self.param_groups):
                _step_group(self, g, group)
            return loss

    _GroupedAdamW8bit = GroupedAdamW8bit
    return GroupedAdamW8bit


_GroupedAdamW8bit = None


def _group_items(opt, group) -> tuple[list, list, list]:
    """(items, step counters, positions) of the parameters of `group` with gradients: each
    item (param, grad, step, exp_avg parts, exp_avg_sq parts) as plain tensors, the states made
    as torchao makes them on first use."""
    if group["amsgrad"]:
        raise ValueError("GroupedAdamW8bit does not implement amsgrad")
    if not isinstance(group["lr"], torch.Tensor):
        raise RuntimeError("lr must stay a tensor: set it with param_groups[i]['lr'].fill_(lr)")
    items, steps, present = [], [], []
    for i, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        present.append(i)
        if p.grad.is_sparse:
            raise RuntimeError("Sparse gradient is not supported")
        state = opt.state[p]
        if len(state) == 0:  # as torchao initialises it
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = opt._new_buffer(p, True)
            state["exp_avg_sq"] = opt._new_buffer(p, False)
        steps.append(state["step"])
        exp_avg, exp_avg_sq = _state_parts(state["exp_avg"]), _state_parts(state["exp_avg_sq"])
        items.append((_local(p.detach()), _local(p.grad), state["step"], exp_avg, exp_avg_sq))
    return items, steps, present


def _group_plan(items: list) -> tuple[list[int], list[list[int]]]:
    """The positions the Triton kernel steps and the chunks of the rest, one compiled call
    each."""
    fused = [k for k, item in enumerate(items) if fused_kernel_takes(item)]
    taken = set(fused)
    rest = [item for k, item in enumerate(items) if k not in taken]
    at = {id(item): k for k, item in enumerate(items)}
    return fused, [[at[id(item)] for item in c] for c in chunks_of_like_tensors(rest)]


def _step_group(opt, g: int, group) -> None:
    """One optimizer step of param group `g`: its fp32 8-bit tensors by the Triton kernel, the
    rest a chunk of like tensors per compiled call."""
    items, steps, present = _group_items(opt, group)
    if not items:
        return
    torch._foreach_add_(steps, 1.0)
    beta1, beta2 = group["betas"]
    key = (g, tuple(present))
    if key not in opt._chunks:
        opt._chunks[key] = _group_plan(items)
    fused, chunks = opt._chunks[key]
    if fused:
        from dtrain.lowp.optim8bit.triton_step import adamw8bit_step

        lr = float(group["lr"])  # torchao keeps lr a CPU tensor: read without a sync
        for k in fused:
            p, grad, step, exp_avg, exp_avg_sq = items[k]
            adamw8bit_step(
                p, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=group["weight_decay"], eps=group["eps"],
            )  # fmt: skip
    # Like torchao: the graphs are the model's, fixed in number; no cache limit.
    with torch._dynamo.utils.disable_cache_limit():
        for chunk in chunks:
            opt._update(
                [items[k] for k in chunk], group["lr"], beta1, beta2, group["weight_decay"],
                group["eps"], opt.bf16_stochastic_round,
            )  # fmt: skip
