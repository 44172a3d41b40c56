"""Checks before a run starts: the run dir, the launch command line, and which checkpoint the
run resumes from (refusing to overwrite another run's checkpoints, or this run's newer ones).
Nothing here writes, except resume=auto setting aside the checkpoints it skipped as bad."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

from dtrain.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    check_newer,
    list_step_dirs,
)
from dtrain.config import RESUME_CHOICES, TrainConfig, compose
from dtrain.errors import ConfigError

# Keys that must match between a checkpoint and the run resuming from it.
IDENTITY_KEYS = {
    "model": (
        "n_layer",
        "n_head",
        "n_kv_head",
        "d_model",
        "ffn_hidden",
        "vocab_size",
        "tie_embeddings",
        "rope",
    ),
    "data": ("source", "tokenizer"),
    "trainer": ("seq_len",),
}


def run_identity(cfg: TrainConfig) -> dict:
    return {
        f"{group}.{key}": getattr(getattr(cfg, group), key)
        for group, keys in IDENTITY_KEYS.items()
        for key in keys
    }


def check_run_dir(run_dir: str | Path) -> None:
    """The run dir must be creatable and writable, checked without writing anything.

    Root ignores permission bits, so this walks up to the nearest existing ancestor and asks
    access(2), which still reports read-only file systems; a file in the way is caught too.
    """
    path = Path(run_dir).absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"run dir {run_dir} cannot be created: {probe} is a file, not a directory; "
            "choose another hydra.run.dir"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run dir {run_dir} is not writable ({probe} is read-only or not ours); "
            "choose another hydra.run.dir"
        )


def refuse_resume_never(cfg: TrainConfig) -> None:
    """resume=never into a run dir that holds checkpoints (complete or not) would overwrite
    or prune them."""
    found = list_step_dirs(Path(cfg.run_dir) / "checkpoints")
    if cfg.resume == "never" and found:
        raise ConfigError(
            f"run dir {cfg.run_dir} already holds checkpoints ({found[-1][1].name}); "
            "resume=never would overwrite them: use resume=auto to continue that run, "
            "or a new hydra.run.dir"
        )


def check_overrides(argv: list[str]) -> TrainConfig | None:
    """Validate a launch command line before Hydra runs (and creates the run dir).

    Returns the config, or None for what only Hydra itself can check (--multirun sweeps,
    --help, --cfg, ...). Also refuses to overwrite another run's checkpoints, and moves a
    run whose default run dir was made with another config to a new one (new_run_dir).
    """
    if any(a.startswith("-") for a in argv):
        return None
    cfg = new_run_dir(compose(list(argv)), argv)
    check_run_dir(cfg.run_dir)
    if cfg.resume not in RESUME_CHOICES:
        manifest = CheckpointManager.read_manifest(Path(cfg.resume))  # complete and intact?
        ckpts = Path(cfg.run_dir) / "checkpoints"
        check_newer(ckpts, Path(cfg.resume), manifest["step"], cfg.checkpoint.overwrite_newer)
    refuse_resume_never(cfg)
    check_parallel_layout(cfg)
    check_fits(cfg)
    from dtrain.precision import check_kernels  # what Gluon needs, before Hydra's first writes

    check_kernels(cfg.precision)
    return cfg


def check_parallel_layout(cfg: TrainConfig) -> None:
    """parallel.tp and parallel.cp against the strategy, the world the launcher set, the heads
    and the sequence, before anything is written (the precision's part waits for the build)."""
    from dtrain.strategies import check_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    seq_len, model = cfg.trainer.seq_len, cfg.model
    check_parallel(cfg.strategy, cfg.parallel, None, world_size=world, model=model, seq_len=seq_len)


# The memory plan is within about 10% of measured peaks (docs/benchmarks.md, "Memory planner"):
# a size is refused only where even a 15% overestimate would not fit.
PLAN_SLACK = 1.15


def check_fits(cfg: TrainConfig) -> None:
    """The memory plan's total per device against the device's memory (the host's on CPU),
    before anything is built: sizes that cannot fit (a billion-token sequence, a model wider
    than any card) are refused in one line naming the value, the limit and what fits."""
    import torch

    from dtrain.memory import plan_memory
    from dtrain.memory.plan import largest_micro_batch
    from dtrain.memory.report import fmt_bytes
    from dtrain.memory.search import device_capacity
    from dtrain.memory.setup import planned_config

    t = cfg.trainer
    if not isinstance(t.micro_batch_size, int):
        return  # auto: the planner picks one that fits
    cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        return  # pick_device says so, in its own words
    device = "cuda" if cuda else "cpu"
    try:
        pcfg, _, setup = planned_config(cfg, int(os.environ.get("WORLD_SIZE", "1")), device)
        plan = plan_memory(pcfg.model, setup)
        capacity = device_capacity(torch.device(device))
    except (ConfigError, ValueError, RuntimeError):
        return  # what the planner cannot plan, the build checks when it gets there
    if plan.total_bytes <= capacity * PLAN_SLACK:
        return  # near the limit the plan may be off: the run tries, and an OOM says what fits
    where = f"this {'GPU' if cuda else 'machine'}'s {fmt_bytes(capacity)}"
    m = cfg.model
    if plan.model_state_bytes > capacity:
        raise ConfigError(
            f"model={m.name} with model.d_model={m.d_model}, n_layer={m.n_layer} "
            f"({plan.n_params:,} parameters) needs {fmt_bytes(plan.model_state_bytes)} per "
            f"device for its weights, gradients and optimizer state alone, more than {where}; "
            "choose a smaller model (or a sharding strategy over more devices)"
        )
    fits = largest_micro_batch(pcfg.model, setup, capacity)
    hint = (
        f"at most trainer.micro_batch_size={fits} fits at this seq_len"
        if fits
        else "even trainer.micro_batch_size=1 does not fit: lower trainer.seq_len"
    )
    raise ConfigError(
        f"trainer.seq_len={t.seq_len} x trainer.micro_batch_size={t.micro_batch_size} needs "
        f"{fmt_bytes(plan.total_bytes)} per device, more than {where}; {hint}"
    )


# Keys that change how a run reports, saves or stops, never what it trains: a run dir made
# with other values of these is still this run's.
NOT_TRAINING = (
    "run_dir",
    "resume",
    "trainer.stop_at_step",
    "trainer.progress_bar",
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.eval_steps",
    "trainer.collective_timeout_s",
    "trainer.stop_signals",
    "trainer.gc_every",
    "data.num_workers",
    "data.cache_dir",
    "data.share_tolerance",
    "checkpoint.",
    "metrics.",
    "inspect.",
    "profile.",
    "downstream.",
)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.loads(json.dumps(v, default=str))  # tuples -> lists
    return out


def _saved_config(run_dir: Path) -> tuple[dict, bool] | None:
    """The config a run dir was made with: .hydra/config.yaml as composed, else the newest
    checkpoint's manifest (as resolved: True); None if it has neither."""
    import yaml

    try:
        hydra = run_dir / ".hydra" / "config.yaml"
        if hydra.is_file():
            data = yaml.safe_load(hydra.read_text())
            return (data, False) if isinstance(data, dict) else None
        for _, step_dir in reversed(list_step_dirs(run_dir / "checkpoints")):
            manifest = json.loads((step_dir / "manifest.json").read_text())
            if isinstance(manifest, dict) and isinstance(manifest.get("config"), dict):
                return manifest["config"], True
    except (OSError, ValueError, RecursionError, yaml.YAMLError):
        return None  # unreadable: resolve_resume judges the run dir as before
    return None


def config_changes(cfg: TrainConfig, run_dir: Path) -> list[str]:
    """`key old -> new` for each key that changes training between the config `run_dir` was
    made with and `cfg` (empty if they agree, or nothing says how it was made)."""
    saved = _saved_config(run_dir)
    if saved is None:
        return []
    old, resolved = _flat(saved[0]), saved[1]
    changes = []
    for key, value in _flat(dataclasses.asdict(cfg)).items():
        if key.startswith(NOT_TRAINING) or key not in old:
            continue
        if resolved and value in (None, "auto"):  # resolved by the build: not comparable
            continue
        if old[key] != value:
            changes.append(f"{key} {old[key]} -> {value}")
    return changes


def new_run_dir(cfg: TrainConfig, argv: list[str]) -> TrainConfig:
    """The default run dir (outputs/<strategy>-<precision>-w<world>-<model>) already made
    with a config that trains differently: this run goes to the first of <dir>-2, <dir>-3,
    ... that is free or was made with this config, said in one line. An explicit
    hydra.run.dir, or resume other than auto, keeps the run dir as given."""
    if cfg.resume != "auto" or any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        return cfg
    base = Path(cfg.run_dir)
    run_dir, n = base, 1
    while run_dir.is_dir() and (changes := config_changes(cfg, run_dir)):
        if n == 1:
            first = changes
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    if run_dir == base:
        return cfg
    if int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(first[:3]) + (f" and {len(first) - 3} more" if len(first) > 3 else "")
        print(
            f"{base} was made by a run with another config ({shown}); this run goes to "
            f"{run_dir} (pass hydra.run.dir=DIR to choose)",
            file=sys.stderr,
            flush=True,
        )
    return dataclasses.replace(cfg, run_dir=str(run_dir))


class ResumePoint(NamedTuple):
    path: Path
    step: int


def resolve_resume(cfg: TrainConfig, ckpt: CheckpointManager) -> ResumePoint | None:
    """Which checkpoint to start from; refuses to overwrite another run's checkpoints, or
    this run's newer ones (unless checkpoint.overwrite_newer). resume=auto sets aside the
    newer ones it skipped as bad, so that no save or pruning touches them."""
    if cfg.resume == "never":
        refuse_resume_never(cfg)
        return None

    def same_run(path: Path, manifest: dict) -> None:
        saved = manifest.get("identity", {})
        for key, value in run_identity(cfg).items():
            if key in saved and saved[key] != value:
                hint = (
                    "choose a new hydra.run.dir for a new run"
                    if cfg.resume == "auto"
                    else "resume it with the config it was trained with"
                )
                raise CheckpointMismatchError(
                    f"checkpoint {path} was saved with {key}={saved[key]!r} but this run has "
                    f"{key}={value!r}; {hint}"
                )

    if cfg.resume == "auto":  # newest intact one; corrupt ones are skipped, with a warning
        found = ckpt.find_resumable(accept=same_run)
        if not found:
            return None
        ckpt.set_aside(ckpt.rejected)
        return ResumePoint(found[0], int(found[1]["step"]))
    path = Path(cfg.resume)
    manifest = CheckpointManager.read_manifest(path)
    same_run(path, manifest)
    check_newer(ckpt.root, path, manifest["step"], cfg.checkpoint.overwrite_newer)
    return ResumePoint(path, int(manifest["step"]))
