"""Baseline: Lightning Fabric training the same dtrain GPT (ddp, fsdp, deepspeed_stage_2).

Same model (dtrain.model.GPT), batch, sequence length and AdamW settings as dtrain; Fabric's own
wrappers and precision plugin ("bf16-mixed"), fabric.backward, fabric.clip_gradients. FSDP is
Fabric's FSDPStrategy wrapping each transformer block. ddp and fsdp are compiled (Fabric's
documented way: torch.compile, then fabric.setup) unless --no-compile; DeepSpeed runs eager.

    torchrun --nproc_per_node=2 bench/fabric_loop.py --model 1b --strategy ddp --out $OUT/f_ddp.json
    torchrun --nproc_per_node=2 bench/fabric_loop.py --model 1b --strategy fsdp --out ...
    torchrun --nproc_per_node=2 bench/fabric_loop.py --model 1b --strategy deepspeed_stage_2 ...
    torchrun --nproc_per_node=2 bench/fabric_loop.py --smoke --strategy ddp   # CPU, tiny model

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.config import compose  # noqa: E402  (only to read the model preset)
from dtrain.model import Block, build_model, flops_per_token  # noqa: E402

PEAK = 989e12  # H100/H200 SXM dense bf16


def build_fabric_strategy(name: str):
    if name == "fsdp":
        from lightning.fabric.strategies import FSDPStrategy

        # Shard each transformer block (as dtrain and the plain loop do); use_orig_params keeps
        # parameters compilable and lets AdamW see decay/no-decay groups.
        return FSDPStrategy(auto_wrap_policy={Block}, use_orig_params=True)
    return name  # "ddp", "deepspeed_stage_2"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1b")
    ap.add_argument("--strategy", choices=["ddp", "fsdp", "deepspeed_stage_2"], default="ddp")
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

    mcfg = compose([f"model={args.model}"]).model
    mcfg.vocab_size = args.vocab
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
    world = fabric.world_size
    tok_s = args.steps * args.micro_batch * args.seq_len * world / dt
    mem = {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
    }
    import torch.distributed as dist

    mems = [mem]
    if dist.is_initialized():
        mems = [None] * world
        dist.all_gather_object(mems, mem)
    fpt = flops_per_token(mcfg, args.seq_len)
    result = {
        "loop": "fabric",
        "wrapper": args.strategy,
        "model": args.model,
        "world_size": world,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "compiled": compiled,
        "tokens_per_s": tok_s,
        "tokens_per_s_per_gpu": tok_s / world,
        "mfu": tok_s / world * fpt / PEAK if cuda else None,
        "memory_per_rank": mems,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "final_loss": loss.item(),
    }
    if fabric.global_rank == 0:
        print(json.dumps(result))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
