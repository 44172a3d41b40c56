"""Multiple-choice scoring by log-likelihood, as lm-evaluation-harness scores acc and acc_norm.

Each (item, choice) pair is one request: the context and the choice tokenized together, the
choice's tokens being those past the context's own (so a BPE merge across the boundary is
tokenized as in training). Its score is the sum of the log-probabilities of the choice's
tokens given what precedes them. acc: the right choice has the highest sum; acc_norm: the
highest sum per character of the choice (so longer choices are not penalised for length).
Ties go to the first choice.

Requests are dealt across ranks (rank r scores every world-th one) in batches of one fixed
shape, the same number of batches on every rank, since a sharded model's forward needs every
rank; the scores are then summed across ranks, so every rank holds all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtrain.evaluation.items import Item


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]  # end-of-text, the context's tokens, then the choice's
    n_choice: int  # how many of the last tokens are the choice's


def encode_requests(items: list[Item], tokenizer, max_len: int) -> list[Request]:
    """One request per choice of each item, in order; contexts cut from the left so that a
    request's inputs fit max_len tokens."""
    out = []
    for item in items:
        ctx = tokenizer.encode(item.context)
        for choice in item.choices:
            whole = tokenizer.encode(item.context + choice)
            cont = whole[len(ctx) :] or tokenizer.encode(choice)
            cont = cont[:max_len]
            head = [tokenizer.eot_id, *whole[: len(whole) - len(cont)]]
            tokens = (head + cont)[-(max_len + 1) :]
            out.append(Request(tuple(tokens), len(cont)))
    return out


def batch_of(requests: list[Request], length: int, pad_id: int):
    """Inputs (B, length), targets and a mask of the choice's positions (B, length)."""
    x = torch.full((len(requests), length), pad_id, dtype=torch.long)
    y = torch.full((len(requests), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), length), dtype=torch.bool)
    for i, r in enumerate(requests):
        n = len(r.tokens) - 1
        x[i, :n] = torch.tensor(r.tokens[:-1])
        y[i, :n] = torch.tensor(r.tokens[1:])
        mask[i, n - r.n_choice : n] = True
    return x, y, mask


@torch.no_grad()
def choice_logprobs(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over each row's masked positions of log p(target): (B,) in float64. Only those
    positions' logits are normalised (a vocab-wide softmax of every position is not needed)."""
    rows = mask.nonzero()[:, 0]
    picked = logits[mask].float().log_softmax(-1)  # (n, vocab)
    lp = picked.gather(-1, y[mask].unsqueeze(-1)).squeeze(-1).double()
    return torch.zeros(mask.shape[0], dtype=torch.float64, device=lp.device).index_add_(0, rows, lp)


def score_requests(
    requests: list[Request],
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    *,
    batch_size: int,
    length: int,
    pad_id: int,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    sum_across_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> list[float]:
    """The log-likelihood of every request's choice, on every rank."""
    mine = list(range(rank, len(requests), world_size))
    per_rank = math.ceil(len(requests) / world_size)
    out = torch.zeros(len(requests), dtype=torch.float64, device=device)
    for start in range(0, per_rank, batch_size):
        idx = mine[start : start + batch_size]
        rows = [requests[i] for i in idx]
        # Every batch full and of one shape: the last rows repeat a request, never counted.
        rows += [requests[0]] * (batch_size - len(rows))
        x, y, mask = (t.to(device) for t in batch_of(rows, length, pad_id))
        lp = choice_logprobs(logits_of(x), y, mask)
        if idx:
            out[torch.tensor(idx, device=device)] = lp[: len(idx)]
    return sum_across_ranks(out).tolist()


def accuracy(items: list[Item], logprobs: list[float]) -> dict[str, float]:
    """acc and acc_norm of items whose choices' log-likelihoods are `logprobs`, in order."""
    right = right_norm = 0
    at = 0
    for item in items:
        lp = logprobs[at : at + len(item.choices)]
        at += len(item.choices)
        norm = [v / len(c) for v, c in zip(lp, item.choices)]
        right += max(range(len(lp)), key=lp.__getitem__) == item.answer
        right_norm += max(range(len(norm)), key=norm.__getitem__) == item.answer
    if at != len(logprobs):
        raise ValueError(f"{len(logprobs)} scores for {at} choices")
    return {"acc": right / len(items), "acc_norm": right_norm / len(items)}
