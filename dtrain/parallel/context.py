"""Context parallelism: each sequence split over the cp ranks, attention gathering the keys and
values of the others (torchtitan's "allgather" rotation; exact: one softmax over every key).

The sequence is cut into 2 x cp chunks and rank r takes chunks r and 2cp-1-r, so under the
causal mask every rank attends over the same number of (query, key) pairs (load balance). Each
rank keeps its tokens' true positions for RoPE and the causal mask.

torch's context_parallel (ring attention over SDPA) is not used: it has no sharding rule for the
CPU's SDPA kernel ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered", torch 2.13), so it cannot run where the tests do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.strategies.base import Collective

# Per block and micro-step: the keys and values gathered forward, their gradients reduced back.
CP_COLLECTIVES = tuple(
    Collective(
        op,
        "kv",
        "compute",
        group="cp",
        per_micro=True,
        calls="blocks",
        why="attention waits for the gathered keys and values (not overlapped)",
    )
    for op in ("all_gather", "reduce_scatter")
)


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions rank `rank` of `cp` holds: chunks rank and 2cp-1-rank of 2cp."""
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([first, second])


class GatheredKVAttention:
    """Causal attention of this rank's queries over every rank's keys and values: an all-gather
    of k and v forward, their gradients reduced back to their ranks backward."""

    def __init__(self, group, seq_len: int, cp: int, rank: int, device: torch.device):
        self.group = group
        local = chunk_positions(seq_len, cp, rank)
        gathered = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])
        self.mask = (local[:, None] >= gathered[None, :]).to(device)  # (T/cp, T): may attend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # The functional collective: its backward is a reduce-scatter on any subgroup (that of
        # torch.distributed.nn emulates one on gloo with scatters from group ranks taken as
        # global ranks, which fails on a cp group that does not start at rank 0).
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        k = all_gather_tensor_autograd(k.contiguous(), 2, self.group)  # (B, nkv, T, hs)
        v = all_gather_tensor_autograd(v.contiguous(), 2, self.group)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: gathered before the repeat
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def apply_cp(model: nn.Module, cp_mesh, seq_len: int, device: torch.device) -> None:
    """Make `model` (a dtrain.model.GPT) train on this rank's chunks of each sequence."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    attend = GatheredKVAttention(cp_mesh.get_group(), seq_len, cp, rank, device)
    for block in model.layers.values():
        block.attn.attend = attend
    model.positions = chunk_positions(seq_len, cp, rank).to(device)
