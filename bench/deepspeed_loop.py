"""Baseline for strategy=zero1/2/3: a plain DeepSpeed loop, the way DeepSpeed's docs write one.

Same model (dtrain.model.GPT), batch, sequence length and optimizer settings as dtrain, but none
of dtrain's machinery: random tokens on the GPU, DeepSpeed's own bf16 and its fused AdamW (from
the "optimizer" section), engine.backward / engine.step, no logging. Eager by default (DeepSpeed's
usual mode); --compile compiles the engine.

    torchrun --nproc_per_node=2 bench/deepspeed_loop.py --model 1b --stage 2 --out $OUT/ds_z2.json
    torchrun --nproc_per_node=2 bench/deepspeed_loop.py --model 1b --stage 3 --out $OUT/ds_z3.json
    torchrun --nproc_per_node=2 bench/deepspeed_loop.py --smoke     # CPU (gloo), tiny model

Prints and writes one JSON object shaped like bench/plain_loop.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.config import compose  # noqa: E402  (only to read the model preset)
from dtrain.model import build_model, flops_per_token  # noqa: E402

PEAK = 989e12  # H100/H200 SXM dense bf16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1b")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo), 3 steps")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.seq_len, args.micro_batch, args.vocab = "tiny", 64, 2, 320
        args.warmup, args.steps, args.compile = 1, 2, False

    import deepspeed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed("nccl" if cuda else "gloo")

    mcfg = compose([f"model={args.model}"]).model
    mcfg.vocab_size = args.vocab
    model = build_model(mcfg, device, seed=0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": cuda},
        "zero_optimization": {"stage": args.stage, "overlap_comm": cuda},
        "optimizer": {
            "type": "AdamW",
            # torch_adam on CPU: DeepSpeed's fused Adam is a CUDA kernel.
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": not cuda},
        },
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    if args.compile:
        engine.compile()
    gen = torch.Generator(device=device).manual_seed(rank)

    def step() -> torch.Tensor:
        tok = torch.randint(
            0, args.vocab, (args.micro_batch, args.seq_len + 1), device=device, generator=gen
        )
        loss = engine(tok[:, :-1], tok[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    for _ in range(args.warmup):
        loss = step()
    loss.item()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    loss.item()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tok_s = args.steps * args.micro_batch * args.seq_len * world / dt
    mem = {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
    }
    mems = [None] * world
    dist.all_gather_object(mems, mem)
    fpt = flops_per_token(mcfg, args.seq_len)
    result = {
        "loop": "deepspeed",
        "wrapper": f"zero{args.stage}",
        "model": args.model,
        "world_size": world,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "compiled": args.compile,
        "deepspeed": deepspeed.__version__,
        "tokens_per_s": tok_s,
        "tokens_per_s_per_gpu": tok_s / world,
        "mfu": tok_s / world * fpt / PEAK if cuda else None,
        "memory_per_rank": mems,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "final_loss": loss.item(),
    }
    if rank == 0:
        print(json.dumps(result))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
