"""A CUDA out-of-memory error turned into advice: the memory plan of this run and the single
changes that fit, fastest first (dtrain.memory.advice; docs/planner.md)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from dtrain import dist as ddist
from dtrain.config import TrainConfig
from dtrain.errors import ConfigError, FaultError
from dtrain.hardware import GpuSpec, gpu_named
from dtrain.reliability.safe_write import write_text

log = logging.getLogger("dtrain")

ADVICE_FILE = "oom_advice.txt"


def device_gpu(device: torch.device) -> tuple[GpuSpec | None, int | None, str]:
    """(the card's GpuSpec or None, its memory in bytes, its name) for a CUDA device."""
    if device.type != "cuda":
        return None, None, device.type
    props = torch.cuda.get_device_properties(device)
    return gpu_named(props.name), props.total_memory, props.name


def advice_text(cfg: TrainConfig, env: ddist.DistEnv) -> str:
    """The advice for this run on this device, or why there is none."""
    from dtrain.memory.advice import oom_advice

    gpu, capacity, name = device_gpu(env.device)
    if gpu is None:
        return (
            f"no memory plan for {name} (not in dtrain.hardware's table); "
            "python -m dtrain.cli.plan gpu=... objective=fastest shows what fits a known card"
        )
    from dtrain.memory.search import resolve_auto_options

    try:
        # `cfg` is resolved as far as the build got (dtrain.run.build.Resolved); auto options
        # not decided yet are decided here for this card alone: no collective, since the
        # other ranks may be waiting in one.
        cfg, _ = resolve_auto_options(
            cfg, env.world_size, env.device, gpu=gpu, capacity_bytes=capacity
        )
        return oom_advice(cfg, env.world_size, gpu, capacity_bytes=capacity, profile="auto")
    except ConfigError as e:  # a configuration the planner does not cover
        return f"no advice for this run: {e}"


def out_of_memory(cfg: TrainConfig, env: ddist.DistEnv, err: BaseException) -> FaultError:
    """The error to stop with (exit 3, on whichever rank ran out): one line, the advice logged
    in full and written to the run dir. Nothing is saved: the state may be mid-step, and the
    other ranks may be waiting in a collective; the last checkpoint stays the resume point.
    `cfg`: the run's config as resolved as far as the build got (dtrain.run.build.Resolved)."""
    if env.device.type == "cuda":
        torch.cuda.empty_cache()  # what the failed step held, so the report itself can run
    advice = advice_text(cfg, env)
    path = Path(cfg.run_dir) / ADVICE_FILE
    # Each rank that ran out writes the advice for its own card (the same text unless the
    # cards differ); the last rename wins whole, and a link planted there is never followed.
    with contextlib.suppress(ConfigError):  # the advice is logged below either way
        write_text(path, advice + "\n", overwrite=True)
    log.error("rank %d ran out of memory; %s", env.rank, advice)
    first = (str(err).strip().splitlines() or ["CUDA out of memory"])[0]
    e = FaultError(
        f"rank {env.rank} ran out of memory: {first}; nothing was saved since the last "
        f"checkpoint; what fits instead is in {path}"
    )
    e.every_rank = True  # each rank that ran out says so
    return e
