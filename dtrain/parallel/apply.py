"""The parallel dimensions applied to a model before FSDP wraps it: TP, then CP."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.config import ParallelConfig
from dtrain.parallel.context import apply_cp
from dtrain.parallel.tensor import apply_tp


def apply_parallel(
    model: nn.Module, mesh, parallel: ParallelConfig, *, seq_len: int, device: torch.device
) -> None:
    """Split `model` (a dtrain.model.GPT on the meta device) over the tp and cp dimensions of
    `mesh` (dtrain.parallel.mesh.build_mesh), in place."""
    if parallel.tp > 1:
        apply_tp(model, mesh["tp"], loss_parallel=parallel.loss_parallel)
    if parallel.cp > 1:
        apply_cp(model, mesh["cp"], seq_len, device)
