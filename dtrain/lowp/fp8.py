"""precision=fp8: torchao's float8 training for the transformer blocks' linears.

Tensorwise scales (one per tensor; under FSDP2 the weights are all-gathered already in fp8,
halving that traffic) or rowwise scales (one per row: more accurate, a little slower). Dynamic
scales; e4m3 inputs and weights, gradients e5m2 (tensorwise) or e4m3 (rowwise), as torchao's
recipes define them. Under torch.compile the transposed copies the weight-gradient GEMMs read
get a kernel of their own (dtrain/lowp/fp8_layout.py); `DTRAIN_FP8_TRANSPOSE=inductor` leaves
them to Inductor's fusion instead (A/B runs).
On hardware without fp8 tensor cores torchao can emulate the casts (`emulate=True`): the
numerics of fp8, the speed of nothing; for tests.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.lowp.fp8_layout import install_transposes_apart


def _fp8_shape_ok(module: nn.Module) -> bool:
    # fp8 GEMMs (torch._scaled_mm) need both matrix dimensions divisible by 16.
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(
    module: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool],
    *,
    recipe: str = "tensorwise",
    emulate: bool = False,
    fp8_all_gather: bool = False,
) -> int:
    """Swap the selected linears for torchao Float8Linear in place; returns how many."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            "precision=fp8 needs torchao, which is not installed: pip install torchao"
        ) from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    # fp8 all-gather exists for tensorwise scales only (one scale per weight shard set).
    fsdp_fp8 = fp8_all_gather and recipe == "tensorwise"
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_fp8)
    selected = []

    def keep(m: nn.Module, fqn: str) -> bool:
        ok = isinstance(m, nn.Linear) and filter_fn(m, fqn) and _fp8_shape_ok(m)
        if ok:
            selected.append(fqn)
        return ok

    convert_to_float8_training(module, config=config, module_filter_fn=keep)
    if os.environ.get("DTRAIN_FP8_TRANSPOSE", "apart") != "inductor":  # "inductor": A/B runs
        install_transposes_apart()
    if fsdp_fp8:
        install_cached_weight_cast()
    return len(selected)


def _cast(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # torchao's _ToFloat8ConstrFunc + to_fp8_saturated, op for op: the same bits.
    fmax = torch.finfo(dtype).max
    return (hp.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(dtype)


_compiled_cast = None


def _fused_cast(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One kernel on CUDA (read fp32, write fp8); eager elsewhere (CPU tests)."""
    global _compiled_cast
    if hp.device.type != "cuda":
        return _cast(hp, scale, dtype)
    if _compiled_cast is None:
        _compiled_cast = torch.compile(_cast, dynamic=True)
    return _compiled_cast(hp, scale, dtype)


def install_cached_weight_cast() -> None:
    """Make FSDP2's fp8 weight all-gather cast each weight shard once per optimizer step, in
    one fused kernel.

    torchao casts the local shard before every all-gather: in the forward and again in the
    backward's re-gather, each time as three eager kernels (multiply, clamp, fp8 copy), a
    large share of an fp8 step (docs/benchmarks.md, "fp8 under fsdp at 8b"). Once the scale
    is precomputed after the step (precompute_fp8_scales), the fp8 shard depends only on the
    weight and that scale: it is cast once, fused, and reused
    until precompute_fp8_scales runs again, which the strategy calls after every optimizer step
    and every load of weights (the weight's version counter cannot tell: the optimizer updates
    the tensor under torchao's wrapper without bumping it). The cache also holds the scale it
    was cast with and is not used with another. Costs one byte per sharded block-linear
    parameter per rank.
    """
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    if getattr(W, "_dtrain_cached_cast", False):
        return
    torchao_pre_all_gather = W.fsdp_pre_all_gather

    def fsdp_pre_all_gather(self, mesh):  # FSDP2 checks this signature
        scale = self._precomputed_scale
        if scale is None:  # before the first step: torchao's dynamic path (one all-reduce)
            return torchao_pre_all_gather(self, mesh)
        cached = getattr(self, "_dtrain_fp8", None)
        if cached is None or cached[0] is not scale:
            cached = (scale, _fused_cast(self._tensor, scale, self._dtype))
            self._dtrain_fp8 = cached
        return (cached[1],), (scale,)

    W.fsdp_pre_all_gather = fsdp_pre_all_gather
    W._dtrain_cached_cast = True


def precompute_fp8_scales(module: nn.Module) -> None:
    """Under FSDP2 with fp8 all-gather: compute all weights' scales in one kernel after each
    optimizer step (instead of one reduction per weight during the next forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
    for p in module.parameters():  # the fp8 shards cast from the old weights are stale now
        local = getattr(p, "_local_tensor", None)
        if hasattr(local, "_dtrain_fp8"):
            del local._dtrain_fp8
