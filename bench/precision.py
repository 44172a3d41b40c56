"""Tokens/s and peak GPU memory of every precision on one GPU, at the same batch.

    python bench/precision.py --out OUT                    # model=1b, seq 2048, micro-batch 8
    python bench/precision.py --out OUT --loss-steps 300   # + the loss after 300 steps of text
    python bench/precision.py --smoke --out OUT            # tiny model on CPU (a test runs it)

Each precision runs in its own process (a clean allocator, peak-memory counter and compile
cache): build the model through dtrain's SingleStrategy (so precision.apply_precision, the loss
scaler and the 8-bit optimizer are exactly what training uses), compile each transformer block
(one compile serves all blocks), train `--warmup` steps, then time `--steps` steps on the
embedded text corpus. Peak memory is torch.cuda.max_memory_allocated over the whole run.
A precision that runs out of memory or fails is reported as such; the others still run.
Writes OUT/precision.json and OUT/precision.md (ratios against bf16 measured in the same run of
the script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name -> (precision, overrides of PrecisionConfig)
VARIANTS: dict[str, tuple[str, dict]] = {
    "fp32-tf32": ("fp32", {"tf32": True}),
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {}),
    "int8": ("int8", {"int8_grad_weight": "int8"}),  # all three matmuls int8
    # SwitchBack: grad_weight in bf16 from the saved int8 input; forward and grad_input int8
    "int8-switchback": ("int8", {"int8_grad_weight": "bf16"}),
    "int8+adamw8bit": ("int8", {"optimizer_8bit": True, "int8_grad_weight": "int8"}),
    "fp8": ("fp8", {}),  # its defaults: delayed scales on one GPU
    "int8-torchao": ("int8-torchao", {}),
}
# Variants not run by default: int8 with Inductor's fused int8 GEMM + dequantize epilogue (a
# Triton template; the int32 product never reaches memory), and fp8 with dynamic scales.
EXTRA_VARIANTS: dict[str, tuple[str, dict]] = {
    "int8-fused": ("int8", {"int8_grad_weight": "int8"}),
    # fp8 as it ran here before fp8_scaling=auto: docs/benchmarks.md's older fp8 rows
    "fp8-dynamic": ("fp8", {"fp8_scaling": "dynamic"}),
}
FUSED = ("int8-fused",)
SMOKE_VARIANTS = ("bf16", "int8", "int8-switchback", "int8-torchao")


def run_one(args: argparse.Namespace) -> dict:
    """Train one variant in this process and return its measurements."""
    import torch

    from dtrain.config import OptimConfig, PrecisionConfig, StrategyConfig, compose
    from dtrain.data import BatchStream, build_data
    from dtrain.dist import DistEnv
    from dtrain.model import flops_per_token
    from dtrain.optim import lr_at
    from dtrain.precision import build_precision
    from dtrain.strategies import build_strategy

    if args.fuse_int_mm_mul or args.one in FUSED:
        import torch._inductor.config as inductor_config

        # Let Inductor fuse the dequantizing multiply into a Triton int8 GEMM's epilogue
        # (no int32 output in memory) instead of cuBLAS + a pointwise kernel.
        inductor_config.force_fuse_int_mm_with_mul = True

    name = args.one
    prec_name, prec_over = {**VARIANTS, **EXTRA_VARIANTS}[name]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    # Built directly: torch's classic allocator segments, as the figures in docs/benchmarks.md
    # were measured (training turns expandable segments on; dtrain.dist.configure_allocator).
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device)
    cfg = compose([f"model={args.model}", "data=embedded", "hydra.run.dir=/tmp/dtrain-bench"])
    seq, mb = args.seq_len, args.micro_batch
    data = build_data(cfg.data, seq_len=seq, seed=0, device=device)
    model_cfg = cfg.model
    model_cfg.vocab_size = model_cfg.vocab_size or args.vocab_size or data.vocab_size
    model_cfg.max_seq_len = max(model_cfg.max_seq_len, seq)

    pcfg = PrecisionConfig(name=prec_name, fp8_emulate=device.type == "cpu", **prec_over)
    precision = build_precision(pcfg, device)
    precision.apply_backend_flags(device)
    strategy = build_strategy(StrategyConfig(name="single", compile=False), precision, env)
    optim_cfg = OptimConfig(lr=args.lr, warmup_steps=min(100, max(1, args.loss_steps // 10)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    strategy.setup(model_cfg, optim_cfg, seed=0)
    if args.compile == "blocks":
        for block in strategy.module.layers.values():
            block.compile()  # identical blocks share one compiled graph
    elif args.compile == "full":
        strategy.model = torch.compile(strategy.module)
    stream = BatchStream(
        data.train,
        micro_batch_size=mb,
        grad_accum_steps=1,
        rank=0,
        world_size=1,
        seed=0,
        device=device,
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    losses: list[float] = []
    total = max(args.warmup + args.steps, args.loss_steps)
    step_times: list[float] = []
    compile_s = None
    for step in range(total):
        if step == args.warmup:
            sync()
            t_timed = time.perf_counter()
        t_step = time.perf_counter()
        (x, y) = stream.next_step()[0]
        loss = strategy.forward_backward(x, y, last_micro=True, loss_div=1)
        strategy.clip_and_step(lr_at(step, optim_cfg, total), 1.0)
        losses.append(loss)
        if step == 0:
            sync()
            compile_s = time.perf_counter() - t_step
        if step == args.warmup + args.steps - 1:
            sync()
            timed_s = time.perf_counter() - t_timed
        if args.warmup <= step < args.warmup + args.steps:
            step_times.append(time.perf_counter() - t_step)
    sync()
    losses = [float(v) for v in losses]
    tokens_per_s = args.steps * mb * seq / timed_s
    out = {
        "variant": name,
        "precision": prec_name,
        "optimizer_8bit": precision.optimizer_8bit,
        "int8_grad_weight": precision.int8_grad_weight or None,
        "tokens_per_s": tokens_per_s,
        "step_s": timed_s / args.steps,
        "first_step_s": compile_s,
        "setup_and_run_s": time.perf_counter() - t0,
        "tflops_per_s": tokens_per_s * flops_per_token(model_cfg, seq) / 1e12,
        "loss_first": losses[0],
        "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "steps_run": total,
        "state_bytes": vars(strategy.state_bytes()),
    }
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["device"] = torch.cuda.get_device_name()
    metrics = strategy.step_metrics()
    if metrics:
        out["step_metrics"] = metrics
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(2):
                (x, y) = stream.next_step()[0]
                strategy.forward_backward(x, y, last_micro=True, loss_div=1)
                strategy.clip_and_step(args.lr * 0.1, 1.0)
            sync()
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (Path(args.out) / f"profile_{name}.txt").write_text(table)
    return out


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    base = next((r for r in results if r.get("variant") == "bf16" and "tokens_per_s" in r), None)
    dev = next((r["device"] for r in results if "device" in r), "cpu")
    lines = [
        f"model={args.model} seq {args.seq_len} micro-batch {args.micro_batch}, 1 device "
        f"({dev}), compile={args.compile}, {args.steps} timed steps after {args.warmup}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| variant | tokens/s | x bf16 | peak mem GiB | x bf16 | first step s | loss (last 10) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['variant']} | {r.get('error', 'failed')} | | | | | |")
            continue
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""
        mem = r.get("peak_mem_gib")
        mem_s = f"{mem:.1f}" if mem is not None else "n/a"
        mem_x = f"{mem / base['peak_mem_gib']:.2f}" if mem is not None and base else ""
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:.0f} | {speed} | {mem_s} | {mem_x} "
            f"| {r['first_step_s']:.1f} | {r['loss_last10']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--model", default="1b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=50304, help="GPT-2's, padded to 64")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles)")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--loss-steps", type=int, default=0, help="train this many steps for a loss")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--compile", choices=("blocks", "full", "none"), default="blocks")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated; also: int8-fused"
    )
    p.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    p.add_argument("--profile", action="store_true", help="OUT/profile_<variant>.txt")
    p.add_argument("--fuse-int-mm-mul", action="store_true", help="Inductor's fused int8 GEMM")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, few steps")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = p.parse_args()
    if args.smoke:
        args.model, args.seq_len, args.micro_batch, args.vocab_size = "tiny", 64, 2, None
        args.warmup, args.steps, args.compile = 1, 2, "none"
        if args.variants == ",".join(VARIANTS):
            args.variants = ",".join(SMOKE_VARIANTS)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return

    results = []
    for name in args.variants.split(","):
        if name not in VARIANTS and name not in EXTRA_VARIANTS:
            choices = ", ".join([*VARIANTS, *EXTRA_VARIANTS])
            sys.exit(f"error: unknown variant {name!r}; choose from {choices}")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line:
                r = json.loads(line[len("RESULT ") :])
            else:
                tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
                err = "OOM" if "OutOfMemoryError" in res.stderr else tail[-160:]
                r = {"variant": name, "error": err}
                (out_dir / f"stderr_{name}.txt").write_text(res.stderr[-20000:])
        except subprocess.TimeoutExpired:
            r = {"variant": name, "error": f"timeout after {args.timeout:.0f}s"}
        r["wall_s"] = time.perf_counter() - t0
        print(json.dumps(r), flush=True)
        results.append(r)
    (out_dir / "precision.json").write_text(json.dumps(results, indent=1))
    md = markdown(results, args)
    (out_dir / "precision.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
