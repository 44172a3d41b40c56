"""The plan picks: every strategy x precision x micro-batch x activation checkpointing (x HSDP
replicate degree) that fits, ranked by predicted tokens/s per GPU; and `micro_batch_size=auto`.

Candidates are planned with the same memory and speed models as a single plan; what a strategy
can run is asked of the strategy (its precisions, options and world-size checks), never decided
here by its name.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, replace

from dtrain.config import AUTO, ParallelConfig, PrecisionConfig, StrategyConfig
from dtrain.errors import ConfigError, UserError
from dtrain.hardware import GiB
from dtrain.memory.machine import Machine
from dtrain.memory.plan import MemoryPlan, largest_micro_batch, plan_memory
from dtrain.memory.setup import MemorySetup, planned_config, precision_for
from dtrain.memory.speed import QUANT_SPEED, SpeedPlan, plan_speed
from dtrain.model import ModelConfig
from dtrain.parallel.mesh import check_layout
from dtrain.precision import PRECISIONS
from dtrain.strategies import STRATEGIES

# trainer.micro_batch_size=auto keeps this share of the GPU free: the plan's peak reserved was
# within -12.6%..+2.1% of the measured one on every GPU point so far (docs/memory.md).
AUTO_MICRO_BATCH_MARGIN = 0.10
# Reference implementations, searched only when asked for (precisions=...).
NOT_SEARCHED = ("int8-torchao",)


@dataclass
class Candidate:
    """One configuration, planned: its memory per GPU and its step."""

    setup: MemorySetup
    memory: MemoryPlan
    speed: SpeedPlan
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.capacity_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.speed.tokens_per_s_per_gpu

    def label(self, batch: bool = True) -> str:
        s = self.setup
        parts = [s.strategy, s.precision.name]
        if batch:
            parts.append(f"micro-batch {s.micro_batch_size}")
        if batch and s.grad_accum_steps > 1:
            parts.append(f"x{s.grad_accum_steps} accumulation")
        if s.activation_checkpointing != "none":
            parts.append(f"checkpointing {s.activation_checkpointing}")
        if s.replicate_degree > 1:
            parts.append(f"{s.replicate_degree} replicas")
        parts += [f"{k} {getattr(s, k)}" for k in ("tp", "cp") if getattr(s, k) > 1]
        if s.honours("reshard_after_forward") and not s.reshard_after_forward:
            parts.append("blocks kept gathered to the backward")
        parts += [key for key in ("cpu_offload", "offload_optimizer") if getattr(s, key)]
        return ", ".join(parts)

    def overrides(self) -> list[str]:
        """The training overrides that run this candidate."""
        s = self.setup
        out = [
            f"strategy={s.strategy}",
            f"precision={s.precision.name}",
            f"trainer.micro_batch_size={s.micro_batch_size}",
            f"trainer.grad_accum_steps={s.grad_accum_steps}",
        ]
        if s.activation_checkpointing != "none":
            out.append(f"strategy.activation_checkpointing={s.activation_checkpointing}")
        if s.replicate_degree > 1:
            out.append(f"strategy.replicate_degree={s.replicate_degree}")
        if s.honours("reshard_after_forward"):  # as planned, not left to auto
            out.append(f"strategy.reshard_after_forward={str(s.reshard_after_forward).lower()}")
        out += [f"strategy.{k}=true" for k in ("cpu_offload", "offload_optimizer") if getattr(s, k)]
        return out


def evaluate(cfg: ModelConfig, setup: MemorySetup, machine: Machine, capacity: int) -> Candidate:
    return Candidate(setup, plan_memory(cfg, setup), plan_speed(cfg, setup, machine), capacity)


def searched_strategies(world_size: int, names=None) -> list[str]:
    """Registry names that can be planned at this world size, one per way of holding memory
    (aliases such as hsdp, the same class and facts as fsdp, are searched through their
    options)."""
    out, seen = [], []
    for name, cls in STRATEGIES.items():
        facts = cls.memory_facts(name)
        if facts is None or (names is not None and name not in names):
            continue
        if cls.needs_distributed != (world_size > 1) or (cls, facts) in seen:
            continue
        seen.append((cls, facts))
        out.append(name)
    return out


def _variants(name: str, world_size: int, precisions, machine: Machine):
    """(precision, activation checkpointing, replicate degree, reshard after forward) the
    strategy accepts (the resharding both ways where the strategy has the option)."""
    cls = STRATEGIES[name]
    accepts = [p for p in precisions if p in cls.precisions]
    checkpointing = ("none", "full", "selective")
    if "activation_checkpointing" not in cls.options:
        checkpointing = ("none",)
    reshards = (True, False) if "reshard_after_forward" in cls.options else (True,)
    degrees = [1]
    if "replicate_degree" in cls.options:
        degrees += [r for r in range(2, world_size) if world_size % r == 0]
    for p in accepts:
        pr = precision_for(PrecisionConfig(name=p), name)  # as a run of `name` builds it
        q = QUANT_SPEED.get(pr.quantize)
        if q is not None and not machine.peak_flops.get(q.kind):
            continue  # no tensor cores for it on this GPU
        for ac in checkpointing:
            for r in degrees:
                scfg = StrategyConfig(name=name, activation_checkpointing=ac, replicate_degree=r)
                try:
                    cls.check_config(scfg, pr, "cuda")
                    cls.check_world(scfg, world_size)
                except UserError:
                    continue
                for keep in reshards:
                    yield pr, ac, r, keep


def composes(name: str, precision, replicate_degree: int) -> bool:
    """Whether strategy `name` takes tp or cp beside this precision and replica count."""
    scfg = StrategyConfig(name=name, replicate_degree=replicate_degree)
    try:
        STRATEGIES[name].check_parallel(scfg, precision)
    except UserError:
        return False
    return True


def layouts(name: str, cfg: ModelConfig, base: MemorySetup, machine: Machine):
    """(tp, cp) of the mesh to try: (1, 1), and where the strategy composes with them, powers
    of two whose tensor-parallel group stays within a node and that divide the world, the
    heads and the sequence."""
    yield 1, 1
    if not STRATEGIES[name].composes_parallel:
        return
    powers = [2**k for k in range(1, base.world_size.bit_length())]
    for tp in [1, *powers]:
        for cp in [1, *powers]:
            if tp * cp == 1 or tp > machine.gpus_per_node:
                continue
            try:
                check_layout(ParallelConfig(tp=tp, cp=cp), base.world_size, cfg, base.seq_len)
            except UserError:
                continue
            yield tp, cp


def _micro_batches(largest: int, global_batch: int | None, world_size: int, accum: int):
    """(micro-batch, accumulation) pairs to try: powers of two up to the largest that fits and
    that largest; with a global batch, those that serve it exactly."""
    if largest < 1:
        return
    sizes = sorted({2**k for k in range(largest.bit_length()) if 2**k <= largest} | {largest})
    for mb in sizes:
        if global_batch is None:
            yield mb, accum
        elif global_batch % (mb * world_size) == 0:
            yield mb, global_batch // (mb * world_size)


def search(
    cfg: ModelConfig,
    base: MemorySetup,
    machine: Machine,
    capacity: int,
    *,
    strategies=None,
    precisions=None,
    global_batch: int | None = None,
    margin: float = AUTO_MICRO_BATCH_MARGIN,
):
    """(candidates that fit `capacity` less `margin`, fastest first; the configurations where
    nothing fits)."""
    capacity = int(capacity * (1 - margin))
    precisions = precisions or [p for p in PRECISIONS if p not in NOT_SEARCHED]
    fitting, ruled_out = [], []
    for name in searched_strategies(base.world_size, strategies):
        variants = _variants(name, base.world_size, precisions, machine)
        for (pr, ac, r, reshard), (tp, cp) in itertools.product(
            variants, list(layouts(name, cfg, base, machine))
        ):
            if tp * cp > 1 and not composes(name, pr, r):
                continue
            setup = replace(
                base,
                strategy=name,
                precision=pr,
                activation_checkpointing=ac,
                replicate_degree=r,
                reshard_after_forward=reshard,
                micro_batch_size=1,
                grad_accum_steps=1,
                tp=tp,
                cp=cp,
            )
            largest = largest_micro_batch(cfg, setup, capacity, limit=1024)
            tried = []
            for mb, accum in _micro_batches(
                largest, global_batch, setup.data_world, base.grad_accum_steps
            ):
                c = evaluate(
                    cfg,
                    replace(setup, micro_batch_size=mb, grad_accum_steps=accum),
                    machine,
                    capacity,
                )
                tried.append(c)
            if tried:
                fitting += tried
            else:
                ruled_out.append(evaluate(cfg, setup, machine, capacity))
    fitting.sort(key=lambda c: (-c.tokens_per_s, c.memory.total_bytes))
    return fitting, ruled_out


def _parts(c: Candidate) -> dict[str, float]:
    s = c.speed
    return {
        "compute": s.compute_s,
        "recompute": s.recompute_s,
        "exposed communication": s.exposed_comm_s,
        "optimizer": s.optimizer_s,
        "other": s.other_s,
    }


def why_first(ranked: list[Candidate], n: int = 3) -> list[str]:
    """A few lines: why the first candidate beats the best of each other configuration (the
    same strategy, precision, checkpointing and replicas at a smaller micro-batch is no news),
    per token, by the parts of the step that differ most."""
    if not ranked:
        return []
    first = ranked[0]
    key = lambda c: (
        c.setup.strategy,
        c.setup.precision.name,  # noqa: E731
        c.setup.activation_checkpointing,
        c.setup.replicate_degree,
        c.setup.reshard_after_forward,
    )
    seen, others = {key(first)}, []
    for c in ranked[1:]:
        if key(c) not in seen:
            seen.add(key(c))
            others.append(c)
    lines = []
    for c in others[:n]:
        gap = 100 * (first.tokens_per_s / c.tokens_per_s - 1)
        a, b = _parts(first), _parts(c)
        # Per token, so that runs of different micro-batches compare.
        diff = {k: (a[k] / first.speed.tokens_per_step - b[k] / c.speed.tokens_per_step) for k in a}
        top = sorted(diff, key=lambda k: diff[k])[:2]
        why = ", ".join(f"{-1e9 * diff[k]:.1f} ns less {k}" for k in top if diff[k] < 0)
        lines.append(
            f"beats {c.label()} ({c.tokens_per_s:,.0f} tokens/s/GPU) by {gap:.1f}%: "
            f"per token {why or 'nothing; it ranks by memory'}"
        )
    return lines


def resolve_auto_micro_batch(
    cfg,
    world_size: int,
    device,
    *,
    gpu=None,
    capacity_bytes: int | None = None,
    margin: float = AUTO_MICRO_BATCH_MARGIN,
) -> int:
    """trainer.micro_batch_size=auto: the largest micro-batch whose planned peak fits the
    device with `margin` of it left free (with trainer.global_batch_size: the largest that also
    divides it). The device's capacity: `capacity_bytes`, else `gpu`'s (a GpuSpec), else what
    CUDA reports for `device`, else the host's memory on CPU. ConfigError if none fits."""
    device_type = getattr(device, "type", str(device)).split(":")[0]
    t = cfg.trainer
    one = replace(
        _lean(cfg),
        trainer=replace(t, micro_batch_size=1, grad_accum_steps=1, global_batch_size=None),
    )
    cfg1, _, setup = planned_config(one, world_size, device_type)
    total, usable = _usable(device, gpu, capacity_bytes, margin)
    best = largest_micro_batch(cfg1.model, setup, usable, limit=4096)
    accum = t.grad_accum_steps
    for mb in range(best, 0, -1):
        if t.global_batch_size is None:
            return mb
        if t.global_batch_size % (mb * world_size) == 0:
            accum = t.global_batch_size // (mb * world_size)
            fits = replace(setup, micro_batch_size=mb, grad_accum_steps=accum)
            if plan_memory(cfg1.model, fits).total_bytes <= usable:
                return mb
    need = plan_memory(cfg1.model, setup).total_bytes
    raise ConfigError(
        f"trainer.micro_batch_size=auto: no micro-batch fits; micro-batch 1 needs "
        f"{need / GiB:.1f} GiB of {usable / GiB:.1f} GiB ({total / GiB:.1f} GiB less "
        f"{margin:.0%} margin); see python -m dtrain.cli.plan objective=fastest"
    )


def auto_to_decide(cfg) -> bool:
    """Whether the config leaves the memory plan anything to decide: trainer.micro_batch_size
    =auto, or strategy.reshard_after_forward=auto under a strategy that honours it."""
    return cfg.trainer.micro_batch_size == AUTO or _reshard_to_decide(cfg)


def _reshard_to_decide(cfg) -> bool:
    s = cfg.strategy
    cls = STRATEGIES.get(s.name)
    return (
        s.reshard_after_forward == AUTO
        and cls is not None
        and "reshard_after_forward" in cls.options
    )


def resolve_auto_options(cfg, world_size: int, device, *, gpu=None, capacity_bytes=None):
    """(cfg with trainer.micro_batch_size=auto and, where the strategy honours it,
    strategy.reshard_after_forward=auto decided, one line per decision): the micro-batch
    first, sized with the leaner resharding, then the resharding for that micro-batch. The
    device's capacity as resolve_auto_micro_batch reads it."""
    notes = []
    kw = {"gpu": gpu, "capacity_bytes": capacity_bytes}
    where = getattr(device, "type", str(device)).split(":")[0]
    # a run decides for its smallest card (dtrain.run.build.with_auto_options)
    on = f"this {where}" if world_size == 1 else f"every {where} of the {world_size}"
    if cfg.trainer.micro_batch_size == AUTO:
        mb = resolve_auto_micro_batch(cfg, world_size, device, **kw)
        cfg = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=mb))
        notes.append(
            f"trainer.micro_batch_size=auto: {mb}, the largest the memory plan fits on {on} "
            f"with {AUTO_MICRO_BATCH_MARGIN:.0%} of its memory left free"
        )
    s = cfg.strategy
    if _reshard_to_decide(cfg):
        if s.cpu_offload:  # offloading asks for the least GPU memory: one block gathered
            reshard, why = True, "strategy.cpu_offload keeps one block gathered at a time"
        else:
            try:
                reshard, need, usable = resolve_auto_reshard(cfg, world_size, device, **kw)
                why = (
                    f"the memory plan with the blocks kept gathered to their backward is "
                    f"{need / GiB:.1f} GiB per {where}, {'over' if reshard else 'within'} the "
                    f"{usable / GiB:.1f} GiB usable ({AUTO_MICRO_BATCH_MARGIN:.0%} left free)"
                )
            except ConfigError as e:  # a run the planner does not cover still trains, lean
                reshard, why = True, f"the memory plan does not cover this run ({e})"
        cfg = replace(cfg, strategy=replace(s, reshard_after_forward=reshard))
        notes.append(f"strategy.reshard_after_forward=auto: {str(reshard).lower()}, {why}")
    return cfg, notes


def _lean(cfg):
    """`cfg` with strategy.reshard_after_forward=auto read as true (the leaner choice): what
    the micro-batch is sized with before the resharding is decided."""
    if cfg.strategy.reshard_after_forward != AUTO:
        return cfg
    return replace(cfg, strategy=replace(cfg.strategy, reshard_after_forward=True))


def resolve_auto_reshard(
    cfg,
    world_size: int,
    device,
    *,
    gpu=None,
    capacity_bytes: int | None = None,
    margin: float = AUTO_MICRO_BATCH_MARGIN,
) -> tuple[bool, int, int]:
    """strategy.reshard_after_forward=auto, for a config whose micro-batch is resolved:
    (false where the plan with every block kept gathered from its forward to its backward fits
    the device with `margin` of it left free, else true; that plan's bytes; the usable bytes).
    Kept gathered, a step gathers each block once instead of twice: 1.02-1.10x the tokens/s
    on 2x H200 (docs/benchmarks.md, "Strategies on 2 GPUs")."""
    device_type = getattr(device, "type", str(device)).split(":")[0]
    keep = replace(cfg, strategy=replace(cfg.strategy, reshard_after_forward=False))
    cfg1, _, setup = planned_config(keep, world_size, device_type)
    _, usable = _usable(device, gpu, capacity_bytes, margin)
    need = plan_memory(cfg1.model, setup).total_bytes
    return need > usable, need, usable


def _usable(device, gpu, capacity_bytes: int | None, margin: float) -> tuple[int, int]:
    """(the device's bytes, what is left of them less `margin`): `capacity_bytes`, else
    `gpu`'s (a GpuSpec), else what CUDA reports for `device`, else the host's memory on CPU."""
    total = capacity_bytes or (gpu.memory_bytes if gpu is not None else device_capacity(device))
    return total, int(total * (1 - margin))


def device_capacity(device) -> int:
    """The bytes of `device`: CUDA's total memory, or the host's on CPU."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
