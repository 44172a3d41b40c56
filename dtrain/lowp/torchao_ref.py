"""precision=int8-torchao: torchao's int8 mixed-precision training, the reference to beat.

With default arguments `quantize_(model, Int8MixedPrecisionTrainingConfig())` swaps each
weight for a tensor subclass that, in our measurements, leaves outputs bitwise equal to the
unquantized ones; `module_swap=True` swaps the module class instead and does run int8 matmuls
(it saves the bf16 input for backward and re-quantizes it there). We use the module swap.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dtrain.errors import ConfigError


def apply_torchao_int8(module: nn.Module, filter_fn: Callable[[nn.Module, str], bool]) -> None:
    try:
        from torchao import quantize_
        from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig
    except ImportError:
        raise ConfigError(
            "precision=int8-torchao needs torchao, which is not installed: pip install torchao"
        ) from None
    quantize_(module, Int8MixedPrecisionTrainingConfig(module_swap=True), filter_fn=filter_fn)
