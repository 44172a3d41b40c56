"""An out-of-memory error, turned into advice: this run's planned memory per GPU, and the
cheapest changes that fit, each with its predicted memory and speed, the fastest first.

    print(oom_advice(cfg, world_size=2, gpu=GPUS["h100-80gb"]))

The changes are the usual ones (a smaller micro-batch with accumulation to keep the batch,
activation checkpointing, sharding everything, offloading, a narrower precision); which
strategy offers which is asked of the strategies (their options and memory facts).
"""

from __future__ import annotations

from dataclasses import replace

from dtrain.memory.machine import build_machine, find_profile
from dtrain.memory.report import fmt_bytes
from dtrain.memory.search import Candidate, evaluate, searched_strategies
from dtrain.memory.setup import MemorySetup, planned_config
from dtrain.precision import PRECISIONS
from dtrain.strategies import STRATEGIES

# Narrower precisions to suggest from each compute width: 4-byte compute -> bf16; 16-bit ->
# fp8 / int8 linears, pure bf16 state.
NARROWER = {4: ("bf16",), 2: ("fp8", "int8", "bf16-true")}


def _changes(setup: MemorySetup) -> list[MemorySetup]:
    """Single changes of `setup`, each a full setup (the advice prices each one)."""
    out = []
    mb, accum = setup.micro_batch_size, setup.grad_accum_steps
    while mb > 1:  # the same batch in more, smaller micro-batches
        mb //= 2
        out.append(
            replace(
                setup, micro_batch_size=mb, grad_accum_steps=accum * setup.micro_batch_size // mb
            )
        )
    hosts = (
        [setup.strategy]
        if setup.honours("activation_checkpointing")
        else [
            n
            for n in searched_strategies(setup.world_size)
            if "activation_checkpointing" in STRATEGIES[n].options
        ]
    )
    for name in hosts[:1]:
        for mode in ("selective", "full"):
            if mode != setup.activation_checkpointing:
                out.append(replace(setup, strategy=name, activation_checkpointing=mode))
    if setup.honours("reshard_after_forward") and not setup.reshard_after_forward:
        out.append(replace(setup, reshard_after_forward=True))  # free blocks after the forward
    for name in searched_strategies(setup.world_size):
        if "params" in STRATEGIES[name].memory_facts(name).shards and name != setup.strategy:
            out.append(replace(setup, strategy=name, activation_checkpointing="none"))
    for name in [setup.strategy, *searched_strategies(setup.world_size)]:
        for key in ("cpu_offload", "offload_optimizer"):
            if key in STRATEGIES[name].options and not getattr(setup, key):
                out.append(replace(setup, strategy=name, **{key: True}))
    width = setup.precision.compute_dtype.itemsize
    for p in NARROWER.get(width, ()):
        if p in STRATEGIES[setup.strategy].precisions and p != setup.precision.name:
            out.append(replace(setup, precision=PRECISIONS[p]))
    return out


def _delta(c: Candidate, base: Candidate) -> str:
    """The overrides that differ from the run's own."""
    own = set(base.overrides())
    return " ".join(o for o in c.overrides() if o not in own) or "(as it is)"


def oom_advice(
    cfg,
    world_size: int,
    gpu,
    *,
    capacity_bytes: int | None = None,
    profile: str = "none",
    top: int = 6,
) -> str:
    """The advice for a run (a TrainConfig) that ran out of memory on `gpu` (a GpuSpec;
    `capacity_bytes` overrides its memory, e.g. what CUDA reported)."""
    cfg, _, setup = planned_config(cfg, world_size, "cuda")
    capacity = capacity_bytes or gpu.memory_bytes
    machine = build_machine(gpu, find_profile(gpu, profile))
    run = evaluate(cfg.model, setup, machine, capacity)
    seen, tried = set(), []
    for s in _changes(setup):
        c = evaluate(cfg.model, s, machine, capacity)
        if tuple(c.overrides()) not in seen:
            seen.add(tuple(c.overrides()))
            tried.append(c)
    fit = sorted((c for c in tried if c.fits), key=lambda c: -c.tokens_per_s)
    big = sorted((c for c in tried if not c.fits), key=lambda c: c.memory.total_bytes)
    m = run.memory
    lines = [
        f"out of memory: {run.label()} on {world_size} x {gpu.name} is planned at "
        f"{fmt_bytes(m.total_bytes)} per GPU; the GPU holds {fmt_bytes(capacity)}",
        "  planned per GPU: "
        + ", ".join(
            f"{k} {fmt_bytes(v)}"
            for k, v in (
                ("parameters", m.params_bytes),
                ("gradients", m.grads_bytes),
                ("optimizer states", m.optim_bytes + m.master_bytes),
                ("activations", m.activations_bytes),
                ("transient", m.transient_bytes),
                ("overhead", m.overhead_bytes),
            )
        ),
    ]
    if fit:
        lines.append("changes that fit, fastest first (planned peak per GPU, tokens/s per GPU):")
    else:
        lines.append("no single change fits; the closest:")
    for c in (fit or big)[:top]:
        lines.append(
            f"  {_delta(c, run)}: {fmt_bytes(c.memory.total_bytes)}, "
            f"{c.tokens_per_s:,.0f} tokens/s "
            f"({c.tokens_per_s / run.tokens_per_s - 1:+.0%} "
            f"vs this run's plan)"
        )
    if fit and big:
        lines.append(f"  (still too big: {'; '.join(_delta(c, run) for c in big[:3])})")
    return "\n".join(lines)
