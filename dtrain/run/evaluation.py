"""Held-out evaluation: each source's loss on its own eval set, and the mixture's.

Every source is scored on the same blocks at every eval (EvalBlocks caches them) through
`strategy.eval_loss`, so it works under every strategy, sharded ones included, and neither
the training data's position nor any random generator moves.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from dtrain.data import eval_batches
from dtrain.evaluation import score_downstream

log = logging.getLogger("dtrain")


def source_loss(r, blocks) -> float:
    """The mean loss over ranks of trainer.eval_steps batches of one source's eval set."""
    t = r.cfg.trainer
    total = torch.zeros((), device=r.env.device)
    for x, y in eval_batches(
        blocks,
        micro_batch_size=t.micro_batch_size,
        steps=t.eval_steps,
        rank=r.stream.rank,  # data-parallel: the ranks of one tp/cp group share a batch
        world_size=r.stream.world,
        device=r.env.device,
    ):
        total += r.strategy.eval_loss(x, y).float()
    return r.strategy.mean_across_ranks(total / t.eval_steps).item()


def ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def evaluate(r, at_step: int) -> float:
    """eval/loss (the mixture's: the sources' losses by weight) and, with several sources,
    eval/<source>/loss and /ppl; eval/seconds. Logged, then the inspector's view."""
    start = time.perf_counter()
    losses = {name: source_loss(r, blocks) for name, blocks in r.data.evals.items()}
    weights = r.data.weights
    loss = sum(weights[n] * v for n, v in losses.items()) / sum(weights[n] for n in losses)
    seconds = time.perf_counter() - start
    scalars = {"eval/loss": loss, "eval/ppl": ppl(loss), "eval/seconds": seconds}
    record = {"step": at_step, "eval_loss": loss, "eval_ppl": ppl(loss), "eval_seconds": seconds}
    if r.data.mixed:
        for name, v in losses.items():
            scalars[f"eval/{name}/loss"] = v
            scalars[f"eval/{name}/ppl"] = ppl(v)
        record["eval_sources"] = {name: {"loss": v, "ppl": ppl(v)} for name, v in losses.items()}
    r.writer.scalars(at_step, scalars)
    r.writer.record(record)
    each = "".join(f" | {n} {v:.4f}" for n, v in losses.items()) if r.data.mixed else ""
    log.info(
        "eval at step %d: loss %.4f, ppl %.2f%s (%.1f s)", at_step, loss, ppl(loss), each, seconds
    )
    score_downstream(r, at_step)  # when downstream.every is due
    # Samples and attention maps are hundreds of small forwards: kept out of a trace.
    r.inspector.on_eval(at_step, skip_reason="profiling" if r.profiler.recording else None)
    return loss
