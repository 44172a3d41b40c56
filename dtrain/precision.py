"""What each precision means, written once. Strategies translate it into their own mechanism
(autocast for single/DDP, MixedPrecisionPolicy for FSDP, a DeepSpeed config section).

docs/precision.md renders this table for people.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dtrain.config import PrecisionConfig
from dtrain.errors import ConfigError


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype  # stored (master) parameters
    compute_dtype: torch.dtype  # matmuls and activations
    reduce_dtype: torch.dtype  # gradient all-reduce / reduce-scatter
    optim_dtype: torch.dtype  # optimizer states (AdamW's two moments)
    loss_scaling: bool = False  # dynamic loss scaling (fp16)
    tf32: bool = False
    summary: str = ""

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the stored parameters (autocast territory)."""
        return self.compute_dtype != self.param_dtype

    def autocast(self, device: torch.device):
        """The autocast context for forward passes (a no-op when compute is the param dtype)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def apply_backend_flags(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32


_F32, _BF16 = torch.float32, torch.bfloat16

PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(
        "fp32", _F32, _F32, _F32, _F32, summary="everything in fp32 (TF32 matmuls if tf32=true)"
    ),
    "bf16": Precision(
        "bf16",
        _F32,
        _BF16,
        _F32,
        _F32,
        summary="bf16 compute, fp32 master weights, fp32 gradient reduction and optimizer states",
    ),
}


def build_precision(cfg: PrecisionConfig, device: torch.device) -> Precision:
    if cfg.name not in PRECISIONS:
        raise ConfigError(
            f"unknown precision '{cfg.name}'; valid choices: {', '.join(sorted(PRECISIONS))}"
        )
    p = PRECISIONS[cfg.name]
    if p.compute_dtype == torch.bfloat16 and device.type == "cuda":
        if not torch.cuda.is_bf16_supported():
            raise ConfigError(f"precision={cfg.name} needs a GPU with bf16 (Ampere or newer)")
    return Precision(**{**p.__dict__, "tf32": cfg.tf32})
