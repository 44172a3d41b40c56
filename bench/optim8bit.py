"""The optimizer step alone, at a model's parameter shapes: fused AdamW, torchao's AdamW8bit
(one compiled call per tensor) and dtrain's step of it (dtrain/lowp/optim8bit/adamw.py: grouped_8bit
as training takes it, the Triton kernel on CUDA where it applies, else compiled groups), on
plain tensors or, with --fsdp, on FSDP2's DTensors (fully_shard on one
rank, each block and then the root, as strategy=fsdp shards them).

    python bench/optim8bit.py --model 1b --out $OUT/optim8bit.jsonl            # CUDA
    python bench/optim8bit.py --model 1b --fsdp --out $OUT/optim8bit_fsdp.jsonl
    python bench/optim8bit.py --model 8b --layers 8 --profile   # 8b's shapes on one GPU, and
        # per variant the kernels a step, their GPU time and the five longest
    python bench/optim8bit.py --smoke       # CPU: model=tiny, eager, one step each: it runs

Each variant prints one JSON line: ms a step (wall, synchronised after the timed steps), the
host's ms a step (until step() returns; where it is near the wall time, the GPU waits for
launches), compiled graphs, peak reserved GiB. Parameters fp32, as every precision but
bf16-true stores them; gradients random, fixed.
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

VARIANTS = ("adamw_fused", "torchao_8bit", "grouped_8bit")


def build_optimizer(name: str, model: torch.nn.Module, compiled: bool):
    from dtrain.config import OptimConfig
    from dtrain.lowp.optim8bit import build_adamw8bit
    from dtrain.optim import build_optimizer as build_adamw
    from dtrain.optim import param_groups

    cfg = OptimConfig()
    if name == "adamw_fused":  # dtrain's: fused on CUDA, foreach on the CPU
        return build_adamw(model, cfg, next(model.parameters()).device)
    if name == "torchao_8bit":
        from torchao.optim import AdamW8bit

        groups = param_groups(model, cfg.weight_decay)
        return AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    # grouped_8bit: dtrain's step as training takes it (the Triton kernel on CUDA where it
    # applies)
    return build_adamw8bit(model, cfg, compiled=compiled)


def gpu_profile(opt, steps: int = 2) -> dict:
    """Kernels a step, as CUDA runs them: how many, their summed time (the GPU's busy time,
    against the wall time where the host is the limit) and the five that take longest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:5]
    return {
        "kernels_step": len(kernels) / steps,
        "gpu_ms_step": round(sum(e.device_time for e in kernels) / steps / 1e3, 3),
        "top_kernels": [
            {
                "name": n[:90],
                "count_step": len(t) / steps,
                "ms_step": round(sum(t) / steps / 1e3, 3),
            }
            for n, t in top
        ],
    }


def run_one(
    name: str, model_name: str, fsdp: bool, iters: int, smoke: bool, layers: int | None, prof: bool
) -> dict:
    from dtrain.config import compose
    from dtrain.model import build_model

    dev = torch.device("cpu" if smoke else "cuda")
    mcfg = compose([f"model={model_name}"]).model
    mcfg.vocab_size = 50304  # GPT-2's, as bench/lowp.sh trains 1b
    if layers:  # the model's shapes with fewer blocks: 8b's fit one GPU beside fused AdamW
        mcfg.n_layer = layers
    model = build_model(mcfg, dev, seed=0)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    gen = torch.Generator(device=dev).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, device=dev) * 1e-3
        if fsdp:  # FSDP2 leaves sharded gradients: a DTensor like the parameter
            from torch.distributed.tensor import distribute_tensor

            p.grad = distribute_tensor(p.grad, p.device_mesh, p.placements)
    opt = build_optimizer(name, model, compiled=not smoke)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(1 if smoke else 3):  # compiles happen here
        opt.step()
    sync()
    graphs = counters["stats"]["unique_graphs"]  # Dynamo's, over the warm-up steps
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(iters):
        h = time.perf_counter()
        opt.step()
        host += time.perf_counter() - h
    sync()
    wall = (time.perf_counter() - t0) / iters
    n_tensors = sum(1 for _ in model.parameters())
    extra = gpu_profile(opt) if prof and dev.type == "cuda" else {}
    return {
        "variant": name,
        "model": model_name,
        "layers": mcfg.n_layer,
        "fsdp": fsdp,
        "tensors": n_tensors,
        "params": sum(p.numel() for p in model.parameters()),
        "ms_step": round(wall * 1e3, 3),
        "host_ms_step": round(host / iters * 1e3, 3),
        "graphs": graphs,
        "peak_reserved_gib": (
            round(torch.cuda.max_memory_reserved() / 2**30, 2) if dev.type == "cuda" else None
        ),
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2's DTensors on one rank")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, help="blocks, if not the model's")
    ap.add_argument("--profile", action="store_true", help="CUDA: kernels a step and GPU time")
    ap.add_argument("--smoke", action="store_true", help="CPU, model=tiny, eager, one step")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        print(f"unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        sys.exit(2)
    if args.smoke:
        args.model, args.iters = "tiny", 1
    if args.fsdp:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        backend = "gloo" if args.smoke else "nccl"
        dist.init_process_group(backend, rank=0, world_size=1)
        if not args.smoke:
            torch.cuda.set_device(0)
    for name in names:
        row = run_one(
            name, args.model, args.fsdp, args.iters, args.smoke, args.layers, args.profile
        )
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
