"""Parameter groups, optimizer construction and the LR schedule (a pure function of the step)."""

from __future__ import annotations

import math

import torch
from torch import nn

from dtrain.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); never decay vectors (norm gains).

    Decaying a norm gain pulls it toward 0 and fights the normalisation; nanoGPT and Llama
    draw the same line by dimension.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over `model` (already wrapped: FSDP's DTensors and DDP's module both work).

    Fused on CUDA (one kernel for all parameters); foreach on CPU, where fused AdamW gives
    different rounding than the reference and buys nothing.
    """
    if cfg.name != "adamw":
        from dtrain.errors import ConfigError

        raise ConfigError(f"unknown optimizer '{cfg.name}'; valid choices: adamw")
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused,
        foreach=None if fused else True,
    )


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps.

    `step` counts optimizer steps done so far (0 for the first update). Being a pure function
    of the step, the schedule needs no state in a checkpoint beyond the step itself.
    """
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= max_steps:
        return min_lr
    span = max(1, max_steps - cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / span
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def short_warmup_warning(cfg: OptimConfig, max_steps: int) -> str | None:
    """The line to warn with when the run ends inside the warmup, else None."""
    if max_steps >= cfg.warmup_steps:
        return None
    last = lr_at(max_steps - 1, cfg, max_steps)
    return (
        f"trainer.max_steps={max_steps} is below optim.warmup_steps={cfg.warmup_steps}: the LR "
        f"never reaches its peak optim.lr={cfg.lr:g} (it rises linearly to {last:.3g} at the "
        f"last step and never decays); lower optim.warmup_steps or raise trainer.max_steps"
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        # A tensor lr (fused/capturable optimizers) is updated in place, avoiding a recompile.
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
