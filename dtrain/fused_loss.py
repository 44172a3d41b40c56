"""The LM head and its cross-entropy fused and chunked over tokens: the full logits (tokens x
vocab) never exist, only one chunk's at a time.

    loss = fused_linear_cross_entropy(x, weight, targets)  # x (N, d), weight (V, d), targets (N,)

equals F.cross_entropy(F.linear(x, weight).float(), targets) (mean over the tokens whose target
is not ignore_index), with the logits in the compute dtype and the log-sum-exp and the loss in
fp32, as dtrain.model.lm_loss computes them. As Liger-Kernel's fused linear cross-entropy does,
the forward also computes each chunk's gradient w.r.t. the hidden states and accumulates the
head weight's (in fp32), so the backward only scales them by the loss's gradient: each chunk's
logits are made once and freed before the next.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

# model.loss_kernel: "fused" (this module), "plain" (the head's logits, then the loss) or
# "auto" (fused where it pays: CUDA with a bf16 compute dtype; fused_loss_active).
LossKernel = Literal["auto", "fused", "plain"]

IGNORE_INDEX = -100  # F.cross_entropy's default, which dtrain.model.lm_loss uses
# A chunk's fp32 logits at most this size by default: small beside the GBs of the full logits,
# large enough that each chunk's matmuls keep a GPU busy (Liger's chunks are of that order).
CHUNK_BYTES = 256 * 2**20


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit CHUNK_BYTES."""
    fit = max(1, CHUNK_BYTES // (4 * vocab_size))
    return 2 ** int(math.log2(fit))


def fused_loss_active(
    kernel: str, device_type: str, compute_dtype: torch.dtype, plain_head: bool = True
) -> bool:
    """Whether the fused loss runs: model.loss_kernel, where "auto" means on CUDA with a bf16
    compute dtype (fp16's tiny gradients need the loss scale inside the kernel, and fp32 has
    nothing to fuse for). A head that is not a plain linear (fp8's) always takes the plain loss."""
    if not plain_head:
        return False
    if kernel == "auto":
        return device_type == "cuda" and compute_dtype == torch.bfloat16
    return kernel == "fused"


def chunk_loss_and_grads(
    x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: the sum of its tokens' losses (fp32), and the gradients of the mean loss
    w.r.t. x and w (in x's dtype), `scale` being 1 / the number of counted tokens."""
    logits = (x @ w.t()).float()  # (n, V): the compute dtype's logits, as F.linear gives them
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, 0)[:, None]
    loss_sum = ((lse - logits.gather(1, safe_t).squeeze(1)) * valid).sum()
    # d loss / d logits = (softmax - one_hot(t)) / N, zero on ignored tokens; in place, so that
    # eagerly one fp32 chunk is alive (compiled, Inductor may fuse these passes into one)
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe_t, torch.full_like(safe_t, -1, dtype=grad.dtype))
    grad = grad.mul_((valid * scale)[:, None]).to(x.dtype)
    return loss_sum, grad @ w, grad.t() @ x


def _chunk_loss(
    x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """One chunk's summed loss, without gradients (evaluation)."""
    logits = (x @ w.t()).float()
    valid = t != ignore_index
    safe_t = torch.where(valid, t, 0)
    target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
    return ((torch.logsumexp(logits, dim=-1) - target_logit) * valid).sum()


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of x @ weight.T against targets, chunk by chunk; the gradients are
    made in the forward (see the module's docstring)."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_tokens, ignore_index, compute_dtype, chunk_fn):
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are set here, explicitly
            xc, wc = x.to(compute_dtype), weight.to(compute_dtype)
            n = x.shape[0]
            # A tensor, never a Python number: no device sync; 0/0 gives NaN as F.cross_entropy
            scale = 1.0 / (targets != ignore_index).sum().float()
            grad_x = torch.empty_like(xc)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            for start in range(0, n, chunk_tokens):
                end = min(start + chunk_tokens, n)
                loss_sum, gx, gw = chunk_fn(
                    xc[start:end], wc, targets[start:end], scale, ignore_index
                )
                loss = loss + loss_sum
                grad_x[start:end] = gx
                grad_w += gw  # fp32 accumulation, without an fp32 copy of each chunk's
        # Saved in the compute dtype, as F.linear's backward would have made it: a bf16 head
        # weight's gradient is half the size of the accumulator.
        ctx.save_for_backward(grad_x, grad_w.to(compute_dtype))
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # The saved gradients are those of the loss itself: the chain rule only scales them.
        gx = (grad_x * grad_output).to(x_dtype)
        gw = (grad_w * grad_output).to(w_dtype)
        return gx, gw, None, None, None, None, None


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    compute_dtype: torch.dtype | None = None,
    chunk_fn=chunk_loss_and_grads,
) -> torch.Tensor:
    """Mean cross-entropy of F.linear(x, weight) against targets, over the tokens whose target
    is not ignore_index, chunked over tokens (x (..., d), weight (V, d), targets (...)).

    compute_dtype: the dtype of the logits' matmuls; None: autocast's where it is on, else x's.
    chunk_tokens: None: default_chunk_tokens(V). chunk_fn: the per-chunk work
    (chunk_loss_and_grads, or a torch.compile of it, which fuses its elementwise passes)."""
    x2, t1 = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    device = x.device.type
    if compute_dtype is None:
        autocast = torch.is_autocast_enabled(device)
        compute_dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return FusedLinearCrossEntropy.apply(
            x2, weight, t1, chunk, ignore_index, compute_dtype, chunk_fn
        )
    with torch.autocast(device, enabled=False):
        xc, wc = x2.to(compute_dtype), weight.to(compute_dtype)
        total = sum(
            _chunk_loss(xc[s : s + chunk], wc, t1[s : s + chunk], ignore_index)
            for s in range(0, x2.shape[0], chunk)
        )
        return total / (t1 != ignore_index).sum().float()
