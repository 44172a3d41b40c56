"""Which fused kernel F.scaled_dot_product_attention takes for a run (trainer.attention_kernel).

`auto` leaves the choice to torch. A named kernel goes first in SDPA's priority order for the
whole run (Inductor fixes SDPA's kernel when it traces, so this must hold while the model is
compiled); every other kernel stays enabled behind it, in the order torch had, for the shapes
the named one cannot take (a decoding step's offset causal mask, an unsupported head size).
`auto` is the fastest on Hopper (torch picks cuDNN; raw outputs of 2026-11-26);
naming one is for comparing kernels or stepping around a kernel's bug.
"""

from __future__ import annotations

import contextlib
import typing

import torch
import torch.compiler.config as compiler_config
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtrain.config import AttentionKernel

KERNELS = typing.get_args(AttentionKernel)  # trainer.attention_kernel; auto: torch's choice
_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


@contextlib.contextmanager
def attention_kernel(name: str):
    """Context for a run: SDPA tries `name`'s kernel first (nothing changes for `auto`)."""
    if name == "auto":
        yield
        return
    first = _BACKENDS[name]
    rest = [SDPBackend(i) for i in torch._C._get_sdp_priority_order() if i != int(first)]
    # AOTAutograd's on-disk cache keys a graph without the SDPA order, so a graph traced under
    # another choice (an earlier run on this machine) would come back with that run's kernel.
    # torch's cache-key tag enters every compile cache's key (environment variables cannot
    # override a patch of it, as they can the caches' on/off switches).
    tag = f"{compiler_config.cache_key_tag}|sdpa={name}"
    with sdpa_kernel([first, *rest], set_priority=True):
        with compiler_config.patch(cache_key_tag=tag):
            yield
