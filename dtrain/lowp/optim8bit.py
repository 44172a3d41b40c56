"""AdamW with 8-bit moments (torchao.optim.AdamW8bit): 2 bytes of optimizer state per parameter
instead of 8, block-wise (256) scaled. torchao's works with FSDP2's DTensors (bitsandbytes' does
not). Tensors under 4096 elements keep fp32 moments (torchao's rule: too small to matter)."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.config import OptimConfig
from dtrain.errors import ConfigError
from dtrain.optim import param_groups


def build_adamw8bit(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.name != "adamw":
        raise ConfigError(
            f"precision.optimizer_8bit=true needs optim=adamw (8-bit AdamW), got {cfg.name!r}"
        )
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise ConfigError(
            "precision.optimizer_8bit=true needs torchao, which is not installed: "
            "pip install torchao"
        ) from None
    # bf16 parameters (bf16-true) round their updates stochastically, so that updates below
    # bf16's resolution are kept on average instead of always lost.
    bf16_params = any(p.dtype == torch.bfloat16 for p in model.parameters())
    return AdamW8bit(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        bf16_stochastic_round=bf16_params,
    )
