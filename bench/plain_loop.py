"""The baseline dtrain must match: a plain, hand-written PyTorch training loop.

Same model (dtrain.model.GPT), same batch, same sequence length, same optimizer as dtrain, but
none of dtrain's machinery: random tokens generated on the GPU, bf16 autocast, fused AdamW,
torch.compile, no logging. Wrappers: none (1 GPU), ddp, fsdp (FSDP2, fully_shard per block).

    python bench/plain_loop.py --model 1b --wrapper none --out $OUT/plain_single.json
    torchrun --nproc_per_node=2 bench/plain_loop.py --model 1b --wrapper ddp --out ...
    python bench/plain_loop.py --smoke          # CPU, tiny model: checks that it runs

Prints and writes one JSON object: tokens/s (all ranks), per GPU, MFU, peak memory per rank.
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
    ap.add_argument("--wrapper", choices=["none", "ddp", "fsdp"], default="none")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, 3 steps")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.seq_len, args.micro_batch, args.vocab = "tiny", 64, 2, 320
        args.warmup, args.steps, args.no_compile = 1, 2, True

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.wrapper != "none":
        dist.init_process_group("nccl" if cuda else "gloo")

    mcfg = compose([f"model={args.model}"]).model
    mcfg.vocab_size = args.vocab
    model = build_model(mcfg, device, seed=0)
    if args.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[local] if cuda else None, gradient_as_bucket_view=True)
        if not args.no_compile:
            model = torch.compile(model)
    elif args.wrapper == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            if not args.no_compile:
                block.compile()
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    elif not args.no_compile:
        model = torch.compile(model)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.wrapper != "fsdp")
    gen = torch.Generator(device=device).manual_seed(rank)

    def step() -> torch.Tensor:
        tok = torch.randint(
            0, args.vocab, (args.micro_batch, args.seq_len + 1), device=device, generator=gen
        )
        with autocast:
            loss = model(tok[:, :-1], tok[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
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
    mems = [mem]
    if dist.is_initialized():
        mems = [None] * world
        dist.all_gather_object(mems, mem)
    fpt = flops_per_token(mcfg, args.seq_len)
    result = {
        "loop": "plain",
        "wrapper": args.wrapper,
        "model": args.model,
        "world_size": world,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "compiled": not args.no_compile,
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
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
