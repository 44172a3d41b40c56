"""Which fused kernel F.scaled_dot_product_attention takes for a run (trainer.attention_kernel).

`auto` leaves the choice to torch; a named kernel goes first in SDPA's priority order for the
whole run (Inductor picks SDPA's kernel when it traces, so this must hold while the model is
compiled), with the others behind it, in torch's order, for the shapes it cannot take (a
decoding step's offset causal mask, an unsupported head size). Measured at the 1b model's
shape (bench/attention_kernels.py, H100, torch 2.11, fwd+bwd): torch's own pick there is
cuDNN, 427 TFLOP/s, against flash 226, memory-efficient 120 and math 16; all within 0.5% of
fp32 math attention. So `auto` is the fast kernel on Hopper; naming one is for comparing
kernels or stepping around a kernel's bug.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtrain.errors import ConfigError

_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
KERNELS = ("auto", *_BACKENDS)  # auto: torch's own choice
_TORCH_ORDER = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
    SDPBackend.CUDNN_ATTENTION,
]


def check_kernel(name: str) -> None:
    if name not in KERNELS:
        raise ConfigError(
            f"trainer.attention_kernel={name!r} is not valid; choose {', '.join(KERNELS)}"
        )


def attention_kernel(name: str, device: torch.device):
    """Context for a run: SDPA tries `name`'s kernel first (a no-op for `auto`)."""
    if name == "auto":
        return contextlib.nullcontext()
    return sdpa_kernel([_BACKENDS[name], *_TORCH_ORDER], set_priority=True)
