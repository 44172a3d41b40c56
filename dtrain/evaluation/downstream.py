"""Downstream scores during training: the tasks' items built and tokenized once at start-up,
scored at eval steps on every rank (the strategy's forward, as the eval loss uses it), logged
by rank 0 as eval/downstream/<task>/acc and acc_norm.

Scoring draws no random numbers and reads no training data, so the training that follows is
the same as without it.
"""

from __future__ import annotations

import logging
import time

from dtrain.config import TrainConfig
from dtrain.evaluation.scorer import accuracy, encode_requests, score_requests
from dtrain.evaluation.tasks import build_tasks

log = logging.getLogger("dtrain")


class DownstreamEval:
    """A run's downstream tasks. Batches have the training micro-batch's shape, so a compiled
    model meets no new shape."""

    def __init__(self, cfg: TrainConfig, tokenizer):
        d, t = cfg.downstream, cfg.trainer
        self.every = d.every
        self.batch_size, self.length = int(t.micro_batch_size), t.seq_len
        self.pad_id = tokenizer.eot_id
        self.items = build_tasks(d.tasks, d.items, d.seed)
        self.requests = {
            task: encode_requests(items, tokenizer, self.length)
            for task, items in self.items.items()
        }

    def due(self, step: int, end: int) -> bool:
        """At every `every`-th step, at step 0 (the untrained baseline) and at the last step."""
        return step % self.every == 0 or step == end

    def score(self, strategy, env) -> dict[str, dict[str, float]]:
        """{task: {"acc": ..., "acc_norm": ...}}, the same on every rank."""
        world = env.world_size
        out = {}
        for task, requests in self.requests.items():
            logprobs = score_requests(
                requests,
                strategy.eval_logits,
                batch_size=self.batch_size,
                length=self.length,
                pad_id=self.pad_id,
                device=env.device,
                rank=env.rank,
                world_size=world,
                sum_across_ranks=lambda t: strategy.mean_across_ranks(t) * world,
            )
            out[task] = accuracy(self.items[task], logprobs)
        return out


def build_downstream(cfg: TrainConfig, tokenizer) -> DownstreamEval | None:
    """The run's downstream tasks, or None when downstream.every is 0."""
    if cfg.downstream.every == 0:
        return None
    return DownstreamEval(cfg, tokenizer)


def flat_scores(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"<task>/acc": ..., "<task>/acc_norm": ...}"""
    return {f"{task}/{k}": v for task, s in scores.items() for k, v in s.items()}


def score_downstream(r, at_step: int) -> dict[str, dict[str, float]] | None:
    """Score the run's tasks if due at this step; logged (TensorBoard, metrics.jsonl, the log)."""
    ds = r.downstream
    if ds is None or not ds.due(at_step, r.end_step):
        return None
    start = time.perf_counter()
    scores = ds.score(r.strategy, r.env)
    seconds = time.perf_counter() - start
    flat = flat_scores(scores)
    r.writer.scalars(at_step, {f"eval/downstream/{k}": v for k, v in flat.items()})
    r.writer.scalars(at_step, {"eval/downstream_s": seconds})
    r.writer.record({"step": at_step, "downstream": flat, "downstream_s": seconds})
    said = ", ".join(
        f"{task} acc {s['acc']:.3f} (norm {s['acc_norm']:.3f})" for task, s in scores.items()
    )
    log.info("downstream at step %d: %s (%.1f s)", at_step, said, seconds)
    return scores
