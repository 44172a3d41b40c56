"""What the baseline loops (plain_loop, deepspeed_loop, fabric_loop) share: their common
arguments, the timed window and the JSON result. Each loop keeps its own model wrapping and
step, the part a baseline is about; the measuring around it is written once so the three are
measured the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.config import compose  # noqa: E402  (only to read the model preset)
from dtrain.model import flops_per_token  # noqa: E402

PEAK = 989e12  # H100/H200 SXM dense bf16


def add_common_args(ap: argparse.ArgumentParser, smoke_help: str) -> None:
    """--model --seq-len --micro-batch --vocab --warmup --steps --out --smoke."""
    ap.add_argument("--model", default="1b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help=smoke_help)


def apply_smoke(args: argparse.Namespace) -> None:
    """--smoke: the tiny model for a few steps (the loop turns compilation off itself)."""
    args.model, args.seq_len, args.micro_batch, args.vocab = "tiny", 64, 2, 320
    args.warmup, args.steps = 1, 2


def model_config(args: argparse.Namespace):
    mcfg = compose([f"model={args.model}"]).model
    mcfg.vocab_size = args.vocab
    return mcfg


def time_steps(step: Callable[[], torch.Tensor], warmup: int, steps: int, cuda: bool):
    """Run `warmup` untimed steps, then time `steps` (peak memory counted from there).
    Returns (seconds, last loss)."""
    for _ in range(warmup):
        loss = step()
    loss.item()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, loss


def report(
    args: argparse.Namespace,
    *,
    loop: str,
    wrapper: str,
    compiled: bool,
    world: int,
    is_main: bool,
    mcfg,
    seconds: float,
    loss: torch.Tensor,
    cuda: bool,
    extra: dict | None = None,
) -> dict:
    """Tokens/s, MFU and peak memory of every rank as one JSON object: printed, and written to
    --out, by the main rank (a collective: every rank calls it)."""
    tok_s = args.steps * args.micro_batch * args.seq_len * world / seconds
    mem = {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
    }
    mems = [mem]
    if dist.is_initialized():
        mems = [None] * world
        dist.all_gather_object(mems, mem)
    fpt = flops_per_token(mcfg, args.seq_len)
    result = {
        "loop": loop,
        "wrapper": wrapper,
        "model": args.model,
        "world_size": world,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "compiled": compiled,
        **(extra or {}),
        "tokens_per_s": tok_s,
        "tokens_per_s_per_gpu": tok_s / world,
        "mfu": tok_s / world * fpt / PEAK if cuda else None,
        "memory_per_rank": mems,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "final_loss": loss.item(),
    }
    if is_main:
        print(json.dumps(result))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    return result
