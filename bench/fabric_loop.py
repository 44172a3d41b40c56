"""Baseline: Lightning Fabric training the same dtrain GPT (ddp, fsdp, deepspeed_stage_2).

Same model (dtrain.model.GPT), batch, sequence length and AdamW settings as dtrain; Fabric's own
wrappers and precision plugin ("bf16-mixed"), fabric.backward, fabric.clip_gradients. FSDP is
Fabric's FSDPStrategy wrapping each transformer block. ddp and fsdp are compiled (Fabric's
documented way: torch.compile, then fabric.setup) unless --no-compile; DeepSpeed runs eager.

    torchrun --nproc_per_node=2 bench/fabric_loop.py --model 1b --strategy ddp --out $OUT/f_ddp.json
    torchrun --nproc_per_node=2 bench/fabric_loop.py --model 1b --strategy fsdp --out ...
    torchrun --nproc_per_node=2 bench/fabric_loop.py --model 1b --strategy deepspeed_stage_2 ...
    torchrun --nproc_per_node=2 bench/fabric_loop.py --smoke --strategy ddp   # CPU, tiny model

Prints and writes one JSON object (bench/loop_harness.py), like bench/plain_loop.py.
"""

from __future__ import annotations

import argparse
import os

import torch
from loop_harness import add_common_args, apply_smoke, model_config, report, time_steps

from dtrain.model import Block, build_model


def build_fabric_strategy(name: str):
    if name == "fsdp":
        from lightning.fabric.strategies import FSDPStrategy

        # Shard each transformer block (as dtrain and the plain loop do); use_orig_params keeps
        # parameters compilable and lets AdamW see decay/no-decay groups.
        return FSDPStrategy(auto_wrap_policy={Block}, use_orig_params=True)
    return name  # "ddp", "deepspeed_stage_2"


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(ap, "tiny model on CPU, 3 steps")
    ap.add_argument("--strategy", choices=["ddp", "fsdp", "deepspeed_stage_2"], default="ddp")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        apply_smoke(args)
        args.no_compile = True

    from lightning.fabric import Fabric

    cuda = torch.cuda.is_available()
    fabric = Fabric(
        accelerator="cuda" if cuda else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
        // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=build_fabric_strategy(args.strategy),
        precision="bf16-mixed" if cuda else "32-true",
    )
    fabric.launch()  # under torchrun: joins the process group torchrun describes
    device = fabric.device

    mcfg = model_config(args)
    compiled = not args.no_compile and args.strategy != "deepspeed_stage_2"
    if args.strategy == "fsdp":
        with fabric.init_module(empty_init=False):
            model = build_model(mcfg, "cpu" if not cuda else device, seed=0)
    else:
        model = build_model(mcfg, device, seed=0)
    if compiled:
        model = torch.compile(model)
    if args.strategy == "fsdp":
        model = fabric.setup_module(model)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=cuda)
    if args.strategy == "fsdp":
        opt = fabric.setup_optimizers(opt)
    else:
        model, opt = fabric.setup(model, opt)
    gen = torch.Generator(device=device).manual_seed(fabric.global_rank)

    def step() -> torch.Tensor:
        tok = torch.randint(
            0, args.vocab, (args.micro_batch, args.seq_len + 1), device=device, generator=gen
        )
        loss = model(tok[:, :-1], tok[:, 1:])
        fabric.backward(loss)
        if args.strategy != "deepspeed_stage_2":
            # Fabric cannot clip a DeepSpeed engine's gradients (DeepSpeed would need
            # gradient_clipping in its own config); that run skips the one norm it costs.
            fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    seconds, loss = time_steps(step, args.warmup, args.steps, cuda)
    report(
        args,
        loop="fabric",
        wrapper=args.strategy,
        compiled=compiled,
        world=fabric.world_size,
        is_main=fabric.global_rank == 0,
        mcfg=mcfg,
        seconds=seconds,
        loss=loss,
        cuda=cuda,
    )


if __name__ == "__main__":
    main()
