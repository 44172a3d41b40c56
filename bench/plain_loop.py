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
import os
import sys

import torch
import torch.distributed as dist
from loop_harness import add_common_args, apply_smoke, model_config, report, time_steps

from dtrain.model import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(ap, "tiny model on CPU, 3 steps")
    ap.add_argument("--wrapper", choices=["none", "ddp", "fsdp"], default="none")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        apply_smoke(args)
        args.no_compile = True

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.wrapper != "none":
        dist.init_process_group("nccl" if cuda else "gloo")

    mcfg = model_config(args)
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

    seconds, loss = time_steps(step, args.warmup, args.steps, cuda)
    report(
        args,
        loop="plain",
        wrapper=args.wrapper,
        compiled=not args.no_compile,
        world=world,
        is_main=rank == 0,
        mcfg=mcfg,
        seconds=seconds,
        loss=loss,
        cuda=cuda,
    )
    if dist.is_initialized():
        dist.barrier()  # every rank past every collective before any tears gloo down
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The measurement is written; leave without the interpreter's teardown. Under fsdp on gloo
    # (CPU smoke) one run in 3-15 aborted after main() had returned, with no Python frame left
    # ("terminate called without an active exception": a C++ thread still joinable when static
    # objects were destroyed; 2026-11-27, torch 2.13), failing a run whose result was complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
