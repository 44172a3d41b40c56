"""Plan a run before paying for it: memory per GPU and the compute budget.

    python -m dtrain.cli.plan model=1b strategy=fsdp precision=bf16 world_size=8 gpu=h100-80gb
    python -m dtrain.cli.plan model=350m strategy=ddp world_size=2 format=json

Takes the training overrides (composed through conf/ exactly as launch/train.py does) plus
plan-only keys: world_size= (default 1), gpu= (default h100-80gb; see GPUS in dtrain.hardware),
format=text|json, mfu= (default 0.4, for GPU-hours), tokens= (default: the run's own
max_steps x global batch x seq_len), profile=auto|none|PATH (speed from a profile written by
dtrain.cli.calibrate; auto: this GPU's profile in ~/.cache/dtrain if there is one, else the
datasheet), gpus_per_node= (default 8), objective=fastest (search strategy x precision x
micro-batch x activation checkpointing x HSDP replicas over what fits, ranked; strategies=
and precisions= limit it, comma-separated; top= how many to list, default 5).
trainer.micro_batch_size=auto plans the largest micro-batch that fits with a 10% margin.
Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

PLAN_KEYS = (
    "world_size",
    "gpu",
    "format",
    "mfu",
    "tokens",
    "objective",
    "profile",
    "gpus_per_node",
    "strategies",
    "precisions",
    "top",
)
OBJECTIVES = ("none", "fastest")


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
    except (ValueError, OverflowError):
        raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if not math.isfinite(x):  # nan compares false with both bounds
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if x < low or (high is not None and x > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"{key} must be {bound}, got {value}")
    return x


@dataclass
class PlanOptions:
    """The plan-only keys, checked."""

    fmt: str
    gpu: object  # dtrain.hardware.GpuSpec
    world: int
    mfu: float
    gpus_per_node: int
    objective: str
    profile: str
    strategies: list[str] | None
    precisions: list[str] | None
    top: int


def plan_options(opts: dict[str, str]) -> PlanOptions:
    from dtrain.errors import ConfigError
    from dtrain.hardware import GPUS
    from dtrain.memory.machine import GPUS_PER_NODE

    fmt = opts.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r}; valid choices: text, json")
    gpu_name = opts.get("gpu", "h100-80gb").lower()
    if gpu_name not in GPUS:
        raise ConfigError(f"unknown gpu '{gpu_name}'; valid choices: {', '.join(GPUS)}")
    objective = opts.get("objective", "none")
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r}; valid choices: {', '.join(OBJECTIVES)}")
    return PlanOptions(
        fmt=fmt,
        gpu=GPUS[gpu_name],
        world=_number(opts.get("world_size", "1"), "world_size", int, 1),
        mfu=_number(opts.get("mfu", "0.4"), "mfu", float, 1e-3, 1.0),
        gpus_per_node=_number(
            opts.get("gpus_per_node", str(GPUS_PER_NODE)), "gpus_per_node", int, 1
        ),
        objective=objective,
        profile=opts.get("profile", "auto"),
        strategies=_choices(opts, "strategies", _registry("strategies")),
        precisions=_choices(opts, "precisions", _registry("precisions")),
        top=_number(opts.get("top", "5"), "top", int, 1),
    )


def _registry(what: str) -> list[str]:
    from dtrain.precision import PRECISIONS
    from dtrain.strategies import STRATEGIES

    return list(STRATEGIES if what == "strategies" else PRECISIONS)


def _choices(opts: dict[str, str], key: str, valid: list[str]) -> list[str] | None:
    """A comma-separated subset of `valid` (None: not given)."""
    from dtrain.errors import ConfigError

    if key not in opts:
        return None
    picked = [x for x in opts[key].split(",") if x]
    for x in picked:
        if x not in valid:
            raise ConfigError(f"{key}= has unknown {x!r}; valid choices: {', '.join(valid)}")
    return picked


def checked_setup(cfg, world: int, gpu):
    """(cfg, precision, setup) for the plan, refusing what training would refuse before it
    starts, with its words and in its order: the strategy's checks, then the batch (the data's
    settings are a note, build_plan's, never a refusal). micro_batch_size=auto and
    reshard_after_forward=auto are resolved as training resolves them (the last item: one line
    per decision)."""
    from dataclasses import replace

    from dtrain.config import resolve_grad_accum
    from dtrain.memory import plan_precision, resolve_vocab, setup_from_config
    from dtrain.memory.search import resolve_auto_options
    from dtrain.precision import fp8_scaling_note
    from dtrain.strategies import STRATEGIES, strategy_class

    cfg = replace(cfg, model=replace(cfg.model, vocab_size=resolve_vocab(cfg)))
    precision = plan_precision(cfg)
    cls = STRATEGIES.get(cfg.strategy.name)
    if cls is not None:
        cls.check_config(cfg.strategy, precision, "cuda")
        cls.check_world(cfg.strategy, world)
    cfg, auto = resolve_auto_options(cfg, world, "cuda", gpu=gpu)
    # precision.fp8_scaling=auto's choice, in the words of the run's start-up line
    shards = strategy_class(cfg.strategy.name).shards_params(cfg.strategy.name)
    if note := fp8_scaling_note(cfg.precision, precision, shards):
        auto = [*auto, note]
    resolve_grad_accum(cfg.trainer, world)
    return cfg, precision, setup_from_config(cfg, precision, world, device="cuda"), auto


def build_plan(argv: list[str]) -> dict:
    """Everything the plan prints, as one JSON-able dict."""
    from dtrain.config import compose
    from dtrain.data import data_note
    from dtrain.hardware import gpu_peak_flops
    from dtrain.memory import compute_budget, largest_micro_batch, plan_memory, summary_text
    from dtrain.memory.machine import build_machine, find_profile
    from dtrain.memory.speed import plan_speed

    opts, overrides = split_args(argv)
    o = plan_options(opts)
    overrides, searched = _search_base(overrides, o)
    cfg, precision, setup, auto = checked_setup(compose(overrides), o.world, o.gpu)
    if searched:
        auto = [*auto, searched]
    world, t = o.world, cfg.trainer
    plan = plan_memory(cfg.model, setup)
    machine = build_machine(o.gpu, find_profile(o.gpu, o.profile), o.gpus_per_node)
    speed = plan_speed(cfg.model, setup, machine)
    run_tokens = t.max_steps * t.micro_batch_size * setup.grad_accum_steps * world * t.seq_len
    tokens = _number(opts["tokens"], "tokens", int, 1) if "tokens" in opts else run_tokens
    peak = gpu_peak_flops(o.gpu, precision)
    budget = compute_budget(
        cfg.model, t.seq_len, tokens, world_size=world, peak_flops=peak, mfu=o.mfu
    )
    chinchilla = compute_budget(
        cfg.model, t.seq_len, None, world_size=world, peak_flops=peak, mfu=o.mfu
    )
    out = {
        "format": o.fmt,
        "model": cfg.model.name,
        "strategy": cfg.strategy.name,
        "precision": precision.name,
        "world_size": world,
        "gpu": o.gpu.name,
        "gpu_memory_bytes": o.gpu.memory_bytes,
        "micro_batch_size": t.micro_batch_size,
        "micro_batch_auto": any(n.startswith("trainer.micro_batch_size") for n in auto),
        "auto": auto,
        "data_note": data_note(cfg.data, world),
        "seq_len": t.seq_len,
        "grad_accum_steps": setup.grad_accum_steps,
        "activation_checkpointing": setup.activation_checkpointing,
        "compile": setup.compile,
        **{k: v for k, v in plan.to_dict().items() if k != "notes"},
        "notes": plan.notes,
        "fits": plan.total_bytes <= o.gpu.memory_bytes,
        "largest_micro_batch": largest_micro_batch(cfg.model, setup, o.gpu.memory_bytes),
        "n_params": budget.n_params,
        "flops_per_token": budget.flops_per_token,
        "chinchilla_tokens": budget.chinchilla_tokens,
        "run": budget.to_dict(),
        "chinchilla": chinchilla.to_dict(),
        "summary": summary_text(plan, setup, cfg.model),
        "speed": speed.to_dict(),
    }
    if o.objective == "fastest":
        out["fastest"] = fastest(cfg, setup, machine, o)
    return out


def _search_base(overrides: list[str], o: PlanOptions) -> tuple[list[str], str | None]:
    """objective=fastest searches the strategies, so none need be given: the detailed plan is
    then the first of strategies= (else fsdp, which runs at any world size) on more than one GPU.
    Returns the overrides and the line that says so (None: the user's own strategy)."""
    given = any(a.lstrip("+~").split("=")[0] in ("strategy", "strategy.name") for a in overrides)
    if o.objective != "fastest" or given or o.world == 1:
        return overrides, None
    base = (o.strategies or ["fsdp"])[0]
    if base == "single":
        base = next((x for x in (o.strategies or []) if x != "single"), "fsdp")
    line = f"strategy: not given, so the plan below is strategy={base}'s; the search tries others"
    return [*overrides, f"strategy={base}"], line


def fastest(cfg, setup, machine, o: PlanOptions) -> dict:
    """objective=fastest: the ranked candidates that fit, why the first wins, what does not fit."""
    from dtrain.memory.search import search, why_first

    ranked, ruled_out = search(
        cfg.model,
        setup,
        machine,
        o.gpu.memory_bytes,
        strategies=o.strategies,
        precisions=o.precisions,
        global_batch=cfg.trainer.global_batch_size,
    )

    def row(c) -> dict:
        return {
            "label": c.label(),
            "config": c.label(batch=False),
            "overrides": c.overrides(),
            "fits": c.fits,
            "total_bytes": c.memory.total_bytes,
            "step_s": c.speed.step_s,
            "tokens_per_s_per_gpu": c.tokens_per_s,
            "mfu": c.speed.mfu,
        }

    why = why_first(ranked)
    if ranked and ranked[0].setup.precision.name != setup.precision.name:
        why.append(
            f"(its precision is not the run's {setup.precision.name}: fp8, int8 and "
            f"bf16-true change the numerics; precisions={setup.precision.name} keeps it)"
        )
    return {
        "ranked": [row(c) for c in ranked[: o.top]],
        "candidates": len(ranked),
        "why": why,
        "ruled_out": [row(c) for c in ruled_out],
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
        f"{p['micro_batch_size']}{' (auto)' if p['micro_batch_auto'] else ''} x {p['seq_len']} "
        f"tokens, accumulation {p['grad_accum_steps']}"
        f" | checkpointing {p['activation_checkpointing']}, compile {p['compile']}",
        *p.get("auto", []),
        *([f"note: {p['data_note']}"] if p.get("data_note") else []),
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
        "",
        *render_speed(p),
    ]
    if "fastest" in p:
        out += ["", *render_fastest(p["fastest"])]
    return "\n".join(out)


def render_speed(p: dict) -> list[str]:
    s = p["speed"]
    step = s["step_s"]
    parts = [
        ("compute", s["compute_s"]),
        ("recompute (activation checkpointing)", s["recompute_s"]),
        ("exposed communication", s["exposed_comm_s"]),
        ("optimizer step", s["optimizer_s"]),
        ("other (data, launches)", s["other_s"]),
    ]
    mfu = "n/a" if s["mfu"] is None else f"{s['mfu']:.1%}"
    out = [f"speed per GPU (figures: {s['machine']})"]
    out += [f"  {k:<44}{1e3 * v:>9.1f} ms {v / step:>6.1%}" for k, v in parts]
    out.append(f"  {'step':<44}{1e3 * step:>9.1f} ms")
    for c in s["collectives"]:
        out.append(
            f"    {c['op']} of {c['tensor']} over {c['ranks']} ranks ({c['link']}): "
            f"{c['bytes'] / 2**30:.2f} GiB, {1e3 * c['seconds']:.1f} ms, "
            f"{1e3 * c['exposed_s']:.1f} exposed ({c['why']})"
        )
    out.append(
        f"  {s['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
        f"({s['tokens_per_s_per_gpu'] * p['world_size']:,.0f} on {p['world_size']}), "
        f"MFU {mfu}"
    )
    out += [f"  note: {n}" for n in s["notes"]]
    return out


def render_fastest(f: dict) -> list[str]:
    from dtrain.memory import fmt_bytes

    out = [
        f"fastest that fit with a 10% margin ({f['candidates']} candidates; tokens/s per GPU, "
        "peak per GPU)"
    ]
    for i, c in enumerate(f["ranked"], 1):
        out.append(
            f"  {i}. {c['label']}: {c['tokens_per_s_per_gpu']:,.0f} tokens/s, "
            f"{fmt_bytes(c['total_bytes'])}"
        )
        if i == 1:
            out.append(f"     {' '.join(c['overrides'])}")
    out += [f"  {'the first ' if line[0] != '(' else ''}{line}" for line in f["why"]]
    if f["ruled_out"]:
        out.append(
            "  ruled out, nothing fits even at micro-batch 1: "
            + "; ".join(f"{c['config']} ({fmt_bytes(c['total_bytes'])})" for c in f["ruled_out"])
        )
    if not f["ranked"]:
        out.append("  nothing fits: more GPUs, a larger GPU or a shorter sequence")
    return out


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
