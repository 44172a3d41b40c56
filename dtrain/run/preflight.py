"""Checks before a run starts: the run dir, the launch command line, and which checkpoint the
run resumes from (refusing to overwrite another run's checkpoints, or this run's newer ones).
Nothing here writes, except resume=auto setting aside the checkpoints it skipped as bad."""

from __future__ import annotations

import os
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
    --help, --cfg, ...). Also refuses to overwrite another run's checkpoints.
    """
    if any(a.startswith("-") for a in argv):
        return None
    cfg = compose(list(argv))
    check_run_dir(cfg.run_dir)
    if cfg.resume not in RESUME_CHOICES:
        manifest = CheckpointManager.read_manifest(Path(cfg.resume))  # complete and intact?
        ckpts = Path(cfg.run_dir) / "checkpoints"
        check_newer(ckpts, Path(cfg.resume), manifest["step"], cfg.checkpoint.overwrite_newer)
    refuse_resume_never(cfg)
    from dtrain.precision import check_kernels  # what Gluon needs, before Hydra's first writes

    check_kernels(cfg.precision)
    return cfg


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
