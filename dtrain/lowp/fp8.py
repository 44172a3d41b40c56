"""precision=fp8: torchao's float8 training for the transformer blocks' linears.

Tensorwise scales (one per tensor; under FSDP2 the weights are all-gathered already in fp8,
halving that traffic) or rowwise scales (one per row: more accurate, a little slower). Dynamic
scales; e4m3 inputs and weights, gradients e5m2 (tensorwise) or e4m3 (rowwise), as torchao's
recipes define them.
On hardware without fp8 tensor cores torchao can emulate the casts (`emulate=True`): the
numerics of fp8, the speed of nothing; for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from dtrain.errors import ConfigError


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
    return len(selected)


def precompute_fp8_scales(module: nn.Module) -> None:
    """Under FSDP2 with fp8 all-gather: compute all weights' scales in one kernel after each
    optimizer step (instead of one reduction per weight during the next forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
