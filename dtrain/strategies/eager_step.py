"""One step of a compiled model run eagerly, in less memory than its compiled steps hold.

fp8 delayed scaling's first step scales dynamically (no amax history yet): its graphs would be
compiled for that one step only, which cost about as long again as the delayed graphs that
every later step runs (dtrain/lowp/fp8/delayed.py). So that step runs eagerly
(`torch.compiler.set_stance("force_eager")`).

Eager, a step keeps what Inductor fuses away, and the caching allocator keeps what it reserved
for the rest of the run: at 1b on one H200 (micro-batch 8 x 2048) a plain eager fp8 first step
peaked at 45.6 GiB allocated and 48.0 reserved, against 37.3 and 38.5 for the compiled steps,
fp8's memory saving gone. So the eager step
- recomputes each transformer block in backward (torch.utils.checkpoint: a block keeps only its
  input): one more forward of one step;
- runs the loss compiled (`set_stance("default")` inside): eager, it would hold an fp32 copy
  of the logits and their log-softmax, 8 bytes a logit (a model with a large vocabulary and
  micro-batch can need more for those than for all its activations). The loss graph is the
  same whatever the scales, and is compiled where the model compiles it apart (blocks).
The first step has no optimizer states yet, so its peak sits below the later steps'.

The blocks must be whole modules called by the model (single, ddp): FSDP's all-gathers run in
the block's forward hooks, which a recompute of `forward` alone would skip."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# The loss compiled for the eager step, per loss function (dtrain.model.lm_loss): made once a
# process, and gone with the function.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(loss_fn):
    if loss_fn not in _COMPILED:
        _COMPILED[loss_fn] = torch.compile(loss_fn)
    return _COMPILED[loss_fn]


def _in_default_stance(loss_fn):
    # torch.compile's wrapper keeps the function it compiles here: compiled already (the blocks
    # scope) it is used as it is, so its graph is the one the later steps run. An eval before
    # the first step (trainer.eval_every, at step 0) compiles it without gradients, and the
    # step then once more with them: one small graph.
    compiled = loss_fn if hasattr(loss_fn, "_torchdynamo_orig_callable") else _compiled(loss_fn)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.compiler.set_stance("default"):
            return compiled(logits, targets)

    return loss


@contextlib.contextmanager
def eager_step(model: nn.Module):
    """Inside: `model` (dtrain's GPT, whatever compiled or wraps it outside) runs its forward
    and backward eagerly, each block recomputed in backward and the loss compiled."""
    blocks = list(model.layers.values())
    own = [block.__dict__.get("forward") for block in blocks]  # an instance's own, if any
    loss_fn = model.loss_fn
    try:
        for block in blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        model.loss_fn = _in_default_stance(loss_fn)
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.loss_fn = loss_fn
        for block, forward in zip(blocks, own, strict=True):
            if forward is None:
                del block.forward  # the class's again
            else:
                block.forward = forward
