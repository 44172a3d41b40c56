"""The compute budget of a run: FLOPs, petaFLOP/s-days and GPU-hours at a stated MFU."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dtrain.model import ModelConfig, count_params, flops_per_token


@dataclass
class ComputeBudget:
    n_params: int
    flops_per_token: float
    chinchilla_tokens: int  # ~20 tokens per parameter (Hoffmann et al. 2022)
    tokens: int  # the run's tokens (its own length, or Chinchilla's when asked)
    total_flops: float
    petaflop_s_days: float
    gpu_hours: float | None  # at `mfu` of `peak_flops` per GPU
    wall_hours: float | None  # gpu_hours / world_size
    mfu: float
    peak_flops: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def compute_budget(
    cfg: ModelConfig,
    seq_len: int,
    tokens: int | None,
    *,
    world_size: int = 1,
    peak_flops: float | None = None,
    mfu: float = 0.4,
) -> ComputeBudget:
    """FLOPs for `tokens` (None: Chinchilla-optimal, 20 per parameter), in petaFLOP/s-days and
    GPU-hours at a stated MFU."""
    n = count_params(cfg)
    fpt = flops_per_token(cfg, seq_len)
    chinchilla = 20 * n
    tokens = chinchilla if tokens is None else tokens
    total = fpt * tokens
    gpu_hours = total / (peak_flops * mfu) / 3600 if peak_flops else None
    return ComputeBudget(
        n_params=n,
        flops_per_token=fpt,
        chinchilla_tokens=chinchilla,
        tokens=tokens,
        total_flops=total,
        petaflop_s_days=total / (1e15 * 86400),
        gpu_hours=gpu_hours,
        wall_hours=gpu_hours / world_size if gpu_hours is not None else None,
        mfu=mfu,
        peak_flops=peak_flops,
    )
