"""Plan a run before paying for it: memory per GPU and the compute budget.

    python -m dtrain.cli.plan model=1b strategy=fsdp precision=bf16 world_size=8 gpu=h100-80gb
    python -m dtrain.cli.plan model=350m strategy=ddp world_size=2 format=json

Takes the training overrides (composed through conf/ exactly as launch/train.py does) plus
plan-only keys: world_size= (default 1), gpu= (default h100-80gb; see GPUS in dtrain.hardware),
format=text|json, mfu= (default 0.4, for GPU-hours), tokens= (default: the run's own
max_steps x global batch x seq_len). Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import json
import sys

PLAN_KEYS = ("world_size", "gpu", "format", "mfu", "tokens")


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Plan-only key=value pairs apart from the Hydra overrides for training."""
    from dtrain.errors import ConfigError

    plan, overrides = {}, []
    for a in argv:
        key, eq, value = a.partition("=")
        if eq and key in PLAN_KEYS:
            if key in plan:
                raise ConfigError(f"{key}= given twice")
            plan[key] = value
        elif a.startswith("-"):
            raise ConfigError(f"unknown option {a!r}; usage: python -m dtrain.cli.plan [key=value]")
        else:
            overrides.append(a)
    return plan, overrides


def _number(value: str, key: str, cast, low: float, high: float | None = None):
    from dtrain.errors import ConfigError

    try:
        x = cast(float(value)) if cast is int and "e" in value.lower() else cast(value)
    except ValueError:
        raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if x < low or (high is not None and x > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"{key} must be {bound}, got {value}")
    return x


def resolve_vocab(cfg) -> int:
    """The model's vocab as the run would set it: model.vocab_size, else the tokenizer's."""
    from dtrain.data.tokenizer import BPE_DEFAULT_VOCAB, ByteTokenizer, padded_vocab
    from dtrain.errors import ConfigError

    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.source == "synthetic" and cfg.data.vocab_size:
        return padded_vocab(cfg.data.vocab_size)
    if cfg.data.tokenizer == "byte":
        return padded_vocab(ByteTokenizer().vocab_size)
    if cfg.data.tokenizer == "bpe":  # trained to exactly data.vocab_size tokens
        return padded_vocab(cfg.data.vocab_size or BPE_DEFAULT_VOCAB)
    raise ConfigError(
        f"cannot tell the vocab of tokenizer {cfg.data.tokenizer!r} without loading it; "
        "add model.vocab_size=N (e.g. 50304 for GPT-2's)"
    )


def build_plan(argv: list[str]) -> dict:
    """Everything the plan prints, as one JSON-able dict."""
    from dataclasses import replace

    import torch

    from dtrain.config import PrecisionConfig, compose, resolve_grad_accum
    from dtrain.errors import ConfigError
    from dtrain.hardware import GPUS, gpu_peak_flops
    from dtrain.memory import (
        compute_budget,
        largest_micro_batch,
        plan_memory,
        setup_from_config,
        summary_text,
    )
    from dtrain.precision import build_precision

    opts, overrides = split_args(argv)
    fmt = opts.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r}; valid choices: text, json")
    gpu_name = opts.get("gpu", "h100-80gb").lower()
    if gpu_name not in GPUS:
        raise ConfigError(f"unknown gpu '{gpu_name}'; valid choices: {', '.join(GPUS)}")
    gpu = GPUS[gpu_name]
    world = _number(opts.get("world_size", "1"), "world_size", int, 1)
    mfu = _number(opts.get("mfu", "0.4"), "mfu", float, 1e-3, 1.0)

    cfg = compose(overrides)
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=resolve_vocab(cfg)))
    # Planned for `gpu`, not for this machine: fp16/fp8 plan on a laptop too.
    precision = build_precision(
        PrecisionConfig(**{**cfg.precision.__dict__}), torch.device("cpu"), check_device=False
    )
    from dtrain.data import check_world_size
    from dtrain.strategies import STRATEGIES

    # What training would refuse before it starts, the plan refuses too, with its words and
    # in its order: the strategy's checks, the batch, then the data's streams.
    cls = STRATEGIES.get(cfg.strategy.name)
    if cls is not None:
        cls.check_config(cfg.strategy, precision, "cuda")
        cls.check_world(cfg.strategy, world)
    accum = resolve_grad_accum(cfg.trainer, world)
    check_world_size(cfg.data, world)
    setup = setup_from_config(cfg, precision, world, device="cuda")
    plan = plan_memory(cfg.model, setup)
    best = largest_micro_batch(cfg.model, setup, gpu.memory_bytes)
    t = cfg.trainer
    run_tokens = t.max_steps * t.micro_batch_size * accum * world * t.seq_len
    tokens = _number(opts["tokens"], "tokens", int, 1) if "tokens" in opts else run_tokens
    peak = gpu_peak_flops(gpu, precision)
    budget = compute_budget(
        cfg.model, t.seq_len, tokens, world_size=world, peak_flops=peak, mfu=mfu
    )
    chinchilla = compute_budget(
        cfg.model, t.seq_len, None, world_size=world, peak_flops=peak, mfu=mfu
    )
    return {
        "format": fmt,
        "model": cfg.model.name,
        "strategy": cfg.strategy.name,
        "precision": precision.name,
        "world_size": world,
        "gpu": gpu.name,
        "gpu_memory_bytes": gpu.memory_bytes,
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "grad_accum_steps": accum,
        "activation_checkpointing": setup.activation_checkpointing,
        "compile": setup.compile,
        **{k: v for k, v in plan.to_dict().items() if k != "notes"},
        "notes": plan.notes,
        "fits": plan.total_bytes <= gpu.memory_bytes,
        "largest_micro_batch": best,
        "n_params": budget.n_params,
        "flops_per_token": budget.flops_per_token,
        "chinchilla_tokens": budget.chinchilla_tokens,
        "run": budget.to_dict(),
        "chinchilla": chinchilla.to_dict(),
        "summary": summary_text(plan, setup, cfg.model),
    }


def render_text(p: dict) -> str:
    from dtrain.memory import fmt_bytes

    def hours(h):
        return "n/a" if h is None else f"{h:,.1f}"

    rows = [
        ("parameters", p["params_bytes"]),
        ("gradients", p["grads_bytes"]),
        ("optimizer states", p["optim_bytes"]),
        ("activations", p["activations_bytes"]),
        ("transient buffers", p["transient_bytes"]),
        ("overhead (allocator slack + CUDA context)", p["overhead_bytes"]),
    ]
    out = [
        f"{p['model']} ({p['n_params'] / 1e6:,.1f}M params) | strategy={p['strategy']} "
        f"precision={p['precision']} | {p['world_size']} x {p['gpu']} | micro-batch "
        f"{p['micro_batch_size']} x {p['seq_len']} tokens, accumulation {p['grad_accum_steps']}"
        f" | checkpointing {p['activation_checkpointing']}, compile {p['compile']}",
        "",
        "memory per GPU (rank 0)",
    ]
    out += [f"  {k:<44}{fmt_bytes(v):>12}" for k, v in rows]
    if p["host_bytes"]:
        out.append(f"  {'(offloaded to host memory)':<44}{fmt_bytes(p['host_bytes']):>12}")
    out.append(
        f"  {'peak at ' + p['phase'] + ' (grads and activations alive then)':<44}"
        f"{fmt_bytes(p['total_bytes']):>12}"
    )
    verdict = "fits" if p["fits"] else "does NOT fit"
    out.append(
        f"  {verdict} in {fmt_bytes(p['gpu_memory_bytes'])}; largest micro-batch that fits: "
        f"{p['largest_micro_batch']}"
    )
    r, c = p["run"], p["chinchilla"]
    out += [
        "",
        "compute",
        f"  FLOPs per token (6N + 12·L·d·T)          {p['flops_per_token']:.4g}",
        f"  this run: {r['tokens']:.4g} tokens -> {r['total_flops']:.4g} FLOPs = "
        f"{r['petaflop_s_days']:.4g} PF/s-days = {hours(r['gpu_hours'])} GPU-hours "
        f"({hours(r['wall_hours'])} h on {p['world_size']}) at MFU {r['mfu']:.0%}",
        f"  Chinchilla-optimal (20 tokens/param): {c['tokens']:.4g} tokens -> "
        f"{c['total_flops']:.4g} FLOPs = {c['petaflop_s_days']:.4g} PF/s-days = "
        f"{hours(c['gpu_hours'])} GPU-hours ({hours(c['wall_hours'])} h on {p['world_size']})",
        "",
        p["summary"],
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from dtrain.cli._kv import exit_with_help_if_asked
    from dtrain.errors import UserError, fail

    argv = sys.argv[1:] if argv is None else argv
    exit_with_help_if_asked(argv, "python -m dtrain.cli.plan", __doc__)
    try:
        plan = build_plan(argv)
    except UserError as e:
        fail(e, rank0_only=False)
    if plan["format"] == "json":
        print(json.dumps(plan))
    else:
        print(render_text(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
