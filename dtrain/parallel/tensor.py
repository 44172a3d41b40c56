"""Tensor parallelism with sequence parallelism (Megatron-LM's, as torchtitan's apply_tp plans
it on DTensor): each block's attention heads and feed-forward hidden units split over the tp
ranks (wq, wk, wv, w1, w3 by columns; wo, w2 by rows), and between them the residual stream
split over the sequence, so the norms run on 1/tp of the tokens and hold no full activation.

Per block and direction that is two all-gathers (the sequence, before attention and before the
feed-forward) and two reduce-scatters (after wo and w2), each of B x T x d activations. The
embedding is split by vocabulary rows; the output layer by vocabulary columns, its logits
either left split by vocabulary for the loss (parallel.loss_parallel: torch's loss_parallel
computes the cross-entropy from the shards) or gathered whole.
"""

from __future__ import annotations

from torch import nn

from dtrain.strategies.base import Collective

# Per block and micro-step, forward and backward: the sequence gathers before attention and the
# feed-forward (and, backward, those after wo and w2), and as many reduce-scatters.
TP_COLLECTIVES = tuple(
    Collective(
        op,
        "activations",
        "compute",
        group="tp",
        times=4,
        per_micro=True,
        calls="blocks",
        why="each matmul waits for its sequence gather or reduce-scatter (no async TP)",
    )
    for op in ("all_gather", "reduce_scatter")
)


def block_plan() -> dict:
    """The plan of one transformer block, keyed by its submodules' names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # Attention's inputs: x (gathered from the sequence shards), rope, kv_cache, need_weights.
    attn_in = PrepareModuleInput(
        input_layouts=(Shard(1), None, None, None),
        desired_input_layouts=(Replicate(), None, None, None),
    )
    return {
        "attn_norm": SequenceParallel(),
        "attn": attn_in,
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "ffn.w1": ColwiseParallel(),
        "ffn.w3": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tp(model: nn.Module, tp_mesh, *, loss_parallel: bool) -> None:
    """Split `model` (a dtrain.model.GPT, still on the meta device) over `tp_mesh` in place;
    `loss_parallel`: its logits stay split by vocabulary (a DTensor the loss must take under
    torch's loss_parallel context), else they are gathered whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    root_plan = {
        # Token ids are whole on every rank; the embedding's output leaves split by sequence.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(model, tp_mesh, root_plan)
    # Tied: the output layer takes the embedding's split weight (both split by vocab rows).
    model.tie_weights()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())
