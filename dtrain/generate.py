"""Sampling from a GPT with a KV cache: greedy, temperature, top-k, top-p (nucleus).

The prompt runs once through the model (the prefill), which fills one (k, v) cache per layer;
each new token then costs one position of compute instead of the whole sequence.

Order of the sampling transforms, as in Hugging Face's `generate`:

    logits / temperature  ->  keep the top_k largest  ->  keep the smallest set whose
    probability mass reaches top_p  ->  renormalise and draw

greedy (or temperature 0) takes the argmax and ignores the rest.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 is greedy
    top_k: int | None = None  # None or 0: no top-k filter
    top_p: float | None = None  # None or 1.0: no nucleus filter
    greedy: bool = False
    use_cache: bool = True  # False recomputes the whole sequence per token (for testing)

    def validate(self) -> None:
        """ValueError with the bad value; the CLIs turn it into a ConfigError."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus. (B, V) -> (B, V).

    The nucleus is the smallest set of most likely tokens whose total probability is >= top_p;
    the most likely token is always kept, so at least one token survives.
    """
    logits = logits.float()
    if top_k:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p: the token that crosses
        # the threshold is kept, and so is the first token whatever its probability.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution a sampled token is drawn from, (B, V) -> (B, V) in fp32."""
    if cfg.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return filter_logits(logits.float() / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)


def sample_next(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row from the last-position logits (B, V). Returns (B, 1) ids."""
    if cfg.is_greedy:
        return logits.argmax(-1, keepdim=True)
    probs = next_token_probs(logits, cfg)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    cfg: SamplingConfig,
    *,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
    autocast=None,
) -> torch.Tensor:
    """Continue `prompt` (B, T) ids by up to cfg.max_new_tokens tokens. Returns (B, T + n).

    stop_id ends generation once every row has produced it (rows that finish early are padded
    with stop_id). Pass stop_id=None where several processes must run the same number of
    forwards (a sharded model: every rank joins each forward's all-gather).
    `autocast` is a context-manager factory for the forward (e.g. a bf16 autocast).
    """
    cfg.validate()
    max_len = model.cfg.max_seq_len
    if prompt.shape[1] + cfg.max_new_tokens > max_len:
        raise ValueError(
            f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({cfg.max_new_tokens}) "
            f"exceeds the model's max_seq_len {max_len}"
        )
    if prompt.shape[1] == 0:
        raise ValueError("the prompt is empty: generation needs at least one token")
    was_training = model.training
    model.eval()
    idx = prompt
    caches = [None] * len(model.layers) if cfg.use_cache else None
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    ctx = autocast or contextlib.nullcontext
    try:
        for i in range(cfg.max_new_tokens):
            if caches is not None:
                # Prefill the whole prompt once, then feed one token at its position.
                step_in, pos = (idx, 0) if i == 0 else (idx[:, -1:], idx.shape[1] - 1)
                with ctx():
                    logits = model(step_in, kv_caches=caches, start_pos=pos)
            else:
                with ctx():
                    logits = model(idx)
            nxt = sample_next(logits[:, -1, :], cfg, generator)  # (B, 1)
            if stop_id is not None:
                nxt = nxt.masked_fill(finished[:, None], stop_id)
                finished |= nxt[:, 0] == stop_id
            idx = torch.cat([idx, nxt], dim=1)
            if stop_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return idx
