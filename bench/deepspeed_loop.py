"""Baseline for strategy=zero1/2/3: a plain DeepSpeed loop, the way DeepSpeed's docs write one.

Same model (dtrain.model.GPT), batch, sequence length and optimizer settings as dtrain, but none
of dtrain's machinery: random tokens on the GPU, DeepSpeed's own bf16 and its fused AdamW (from
the "optimizer" section), engine.backward / engine.step, no logging. Eager by default (DeepSpeed's
usual mode); --compile compiles the engine.

    torchrun --nproc_per_node=2 bench/deepspeed_loop.py --model 1b --stage 2 --out $OUT/ds_z2.json
    torchrun --nproc_per_node=2 bench/deepspeed_loop.py --model 1b --stage 3 --out $OUT/ds_z3.json
    torchrun --nproc_per_node=2 bench/deepspeed_loop.py --smoke     # CPU (gloo), tiny model

Prints and writes one JSON object (bench/loop_harness.py), like bench/plain_loop.py.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from loop_harness import add_common_args, apply_smoke, model_config, report, time_steps

from dtrain.model import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(ap, "tiny model on CPU (gloo), 3 steps")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        apply_smoke(args)
        args.compile = False

    import deepspeed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed("nccl" if cuda else "gloo")

    mcfg = model_config(args)
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

    seconds, loss = time_steps(step, args.warmup, args.steps, cuda)
    report(
        args,
        loop="deepspeed",
        wrapper=f"zero{args.stage}",
        compiled=args.compile,
        world=world,
        is_main=rank == 0,
        mcfg=mcfg,
        seconds=seconds,
        loss=loss,
        cuda=cuda,
        extra={"deepspeed": deepspeed.__version__},
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
