"""precision=fp8: torchao's float8 training for the transformer blocks' linears.

Tensorwise scales (one per tensor; under FSDP2 the weights are all-gathered already in fp8,
halving that traffic) or rowwise scales (one per row: more accurate, a little slower). Dynamic
scales; e4m3 inputs and weights, gradients e5m2 (tensorwise) or e4m3 (rowwise), as torchao's
recipes define them. Under torch.compile the transposed copies the weight-gradient GEMMs read
get a kernel of their own (dtrain/lowp/fp8/layout.py): at 8b under fsdp 1.227x bf16's tokens/s
against 1.156x with them left to Inductor's fusion (docs/benchmarks.md).
On hardware without fp8 tensor cores torchao can emulate the casts (`emulate=True`): the
numerics of fp8, the speed of nothing; for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.hardware import fp8_gemm_dims_ok
from dtrain.lowp.fp8.layout import install_transposes_apart, install_weight_transposes_in_backward


def fp8_shape_ok(module: nn.Module) -> bool:
    return fp8_gemm_dims_ok(module.in_features, module.out_features)


def apply_fp8(
    module: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool],
    *,
    recipe: str = "tensorwise",
    emulate: bool = False,
    fp8_all_gather: bool = False,
    fast_accum: str = "grad_input",
    scaling: str = "dynamic",
    amax_history: int = 16,
) -> int:
    """Swap the selected linears for torchao Float8Linear in place; returns how many.

    `fast_accum`: which GEMMs accumulate without torchao's periodic promotion to fp32: the
    forward one ("forward", torchao's recipe), "grad_input" too (the default), or "all" three.
    The grad-weight GEMM sums over every token of the micro-batch (16384 at 1b), the grad-input
    one over a layer's width, so that one loses the least: it trained at bf16's loss in every
    run measured, the grad-weight one did not (docs/precision.md: loss and speed of each).
    `scaling="delayed"`: inputs and output gradients cast with scales from the last
    `amax_history` steps' amaxes (dtrain/lowp/fp8/delayed.py)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            "precision=fp8 needs torchao, which is not installed: pip install torchao"
        ) from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fast_accum != "forward":
        from torchao.float8.config import Float8GemmConfig

        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast)
        if fast_accum == "all":
            config = dataclasses.replace(config, gemm_config_grad_weight=fast)
    # fp8 all-gather exists for tensorwise scales only (one scale per weight shard set).
    fsdp_fp8 = fp8_all_gather and recipe == "tensorwise"
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_fp8)
    selected = []

    def keep(m: nn.Module, fqn: str) -> bool:
        ok = isinstance(m, nn.Linear) and filter_fn(m, fqn) and fp8_shape_ok(m)
        if ok:
            selected.append(fqn)
        return ok

    convert_to_float8_training(module, config=config, module_filter_fn=keep)
    if scaling == "delayed":
        from dtrain.lowp.fp8.delayed import install_delayed_scaling

        install_delayed_scaling(module, amax_history)
    install_transposes_apart()
    if fsdp_fp8:
        install_cached_weight_cast()
        install_weight_transposes_in_backward()
    return len(selected)


def _cast(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # torchao's _ToFloat8ConstrFunc + to_fp8_saturated, op for op: the same bits.
    fmax = torch.finfo(dtype).max
    return (hp.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(dtype)


def _cast_all(hps: list[torch.Tensor], scales: list[torch.Tensor], dtype: torch.dtype):
    return [_cast(hp, scale, dtype) for hp, scale in zip(hps, scales, strict=True)]


_compiled_cast_all = None


def cast_shards(
    hps: list[torch.Tensor], scales: list[torch.Tensor], dtype: torch.dtype, *, compiled: bool
):
    """Every weight shard to fp8 with its scale: with `compiled` one compiled call for all of
    them (one fused kernel per shard, read fp32 and write fp8, launched from one graph); eager
    otherwise (strategy.compile=false, and shards offloaded to the host by
    strategy.cpu_offload).

    One call for the whole model, not one per weight: cast one at a time (the first form of
    this cache, in FSDP's pre-all-gather) each cast was a compiled region of its own, 0.3-0.6 ms
    of host time, seven per block, and at model=1b under fsdp on 2 H200s the host then fell
    behind the GPU: 236 ms a step of the compute stream idle waiting for launches, and fp8
    at 0.87x bf16 (98.7k against 113.6k tokens/s, raw outputs of 2026-11-28)."""
    global _compiled_cast_all
    if not hps or not compiled:
        return _cast_all(hps, scales, dtype)
    if _compiled_cast_all is None:
        # Shapes are the model's, fixed for the run: no dynamic shapes, one graph.
        _compiled_cast_all = torch.compile(_cast_all, dynamic=False)
    return _compiled_cast_all(hps, scales, dtype)


def install_cached_weight_cast() -> None:
    """Make FSDP2's fp8 weight all-gather use the shard precompute_fp8_scales cast.

    torchao casts the local shard before every all-gather: in the forward and again in the
    backward's re-gather, each time as three eager kernels (multiply, clamp, fp8 copy), a
    large share of an fp8 step (docs/benchmarks.md, "fp8 under fsdp at 8b"). Once the scale
    is precomputed after the step, the fp8 shard depends only on the weight and that scale:
    precompute_fp8_scales casts every shard then, all in one call (cast_shards), and the
    all-gathers reuse them until it runs again, which the strategy does after every optimizer
    step and every load of a checkpoint (Strategy.clip_and_step and .load_state_dict, the only
    places the weights change once a scale exists; the weight's version counter cannot tell:
    the optimizer updates the tensor under torchao's wrapper without bumping it). A cached
    shard is used only with the scale it was cast with; otherwise torchao's own cast runs (the
    same bits). Like torchao's precomputed scales, this needs that hook after every step. Costs
    one byte per sharded block-linear parameter per rank.
    """
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    if getattr(W, "_dtrain_cached_cast", False):
        return
    torchao_pre_all_gather = W.fsdp_pre_all_gather

    def fsdp_pre_all_gather(self, mesh):  # FSDP2 checks this signature
        scale = self._precomputed_scale
        cached = getattr(self, "_dtrain_fp8", None)
        if scale is None or cached is None or cached[0] is not scale:
            # No scale yet (before the first step: dynamic), or no shard cast with this one.
            return torchao_pre_all_gather(self, mesh)
        return (cached[1],), (scale,)

    W.fsdp_pre_all_gather = fsdp_pre_all_gather
    W._dtrain_cached_cast = True


@torch.no_grad()
def precompute_fp8_scales(module: nn.Module, *, compiled: bool = False) -> None:
    """Under FSDP2 with fp8 all-gather: compute all weights' scales in one kernel after each
    optimizer step (instead of one reduction per weight during the next forward), then cast
    every weight shard with its new scale for the all-gathers to reuse
    (install_cached_weight_cast); `compiled`: that cast in one compiled call (cast_shards)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    precompute_float8_dynamic_scale_for_fsdp(module)
    shards = []
    for p in module.parameters():
        local = getattr(p, "_local_tensor", None)
        if isinstance(local, W) and local._precomputed_scale is not None:
            shards.append(local)
    if not shards or not getattr(W, "_dtrain_cached_cast", False):
        return
    (dtype,) = {t._dtype for t in shards}  # torchao's precompute allows one target dtype
    for t in shards:  # stale now; dropped first so that old and new are never held together
        t.__dict__.pop("_dtrain_fp8", None)
    scales = [t._precomputed_scale for t in shards]
    for t, scale, fp8 in zip(
        shards, scales, cast_shards([t._tensor for t in shards], scales, dtype, compiled=compiled)
    ):
        t._dtrain_fp8 = (scale, fp8)
