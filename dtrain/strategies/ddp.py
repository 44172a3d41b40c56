"""strategy=ddp: DistributedDataParallel, every rank a full replica, gradients all-reduced.

Gradients are views into DDP's buckets (gradient_as_bucket_view), so a rank holds one copy of
them, not two. Non-final micro-steps skip the all-reduce (no_sync).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"
    needs_distributed = True

    def wrap(self, module: nn.Module) -> nn.Module:
        self._ddp = DDP(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        # Compiling the DDP module lets Dynamo's DDPOptimizer split graphs at bucket
        # boundaries, so all-reduces still overlap the backward.
        return torch.compile(self._ddp) if self.compile_enabled else self._ddp

    def no_sync(self, last_micro: bool):
        return contextlib.nullcontext() if last_micro else self._ddp.no_sync()
