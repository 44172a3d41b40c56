"""Optional loggers beside TensorBoard and metrics.jsonl: Weights & Biases and MLflow.

Each gets what TensorBoard gets: every scalar at its step, the run's hparams (and the whole
config), compare's memory chart and the final summary. Their libraries are extras
(`pip install 'dtrain[wandb]'`, `'dtrain[mlflow]'`), imported only when a logger is on;
config validation has already checked they are installed. Rank 0 alone logs.

A logger is any object with start / scalars / figure / summary / close, as below.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

from dtrain.config import MetricsConfig, MlflowConfig, WandbConfig


def run_id(run_dir: Path, name: str) -> str:
    """Stable per run dir and configuration, so a resumed run continues the same W&B run and
    MLflow run (lowercase hex: valid for both)."""
    return hashlib.sha1(f"{Path(run_dir).resolve()}|{name}".encode()).hexdigest()[:16]


def _finite(values: dict) -> dict:
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class WandbLogger:
    """Offline by default: files under <dir>/wandb/offline-run-*, uploaded by `wandb sync`."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, name: str):
        import wandb

        self.wandb = wandb
        directory = Path(cfg.dir) if cfg.dir else Path(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or name,
            dir=str(directory),
            mode=cfg.mode,
            tags=list(cfg.tags) or None,
            id=run_id(run_dir, name),
            resume="allow",
        )

    def start(self, hparams: dict, config: dict) -> None:
        self.run.config.update({**hparams, "config": config}, allow_val_change=True)

    def scalars(self, step: int, values: dict) -> None:
        values = _finite(values)
        if values:
            self.run.log(values, step=step)

    def figure(self, tag: str, fig, step: int) -> None:
        self.run.log({tag: self.wandb.Image(fig)}, step=step)

    def summary(self, final: dict) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in final.items()})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowLogger:
    """Through MlflowClient (no global active run). The store: metrics.mlflow.tracking_uri,
    else $MLFLOW_TRACKING_URI, else a file store in the run dir."""

    def __init__(self, cfg: MlflowConfig, run_dir: Path, name: str):
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (Path(run_dir) / "mlruns").absolute().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses its file store unless asked: a file: URI (or a path) is asking.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        exp = self.client.get_experiment_by_name(cfg.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
        rid = run_id(run_dir, name)
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`dtrain.run_id` = '{rid}'", max_results=1
        )
        self.resumed = bool(found)
        if found:  # a resumed run continues its MLflow run
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"dtrain.run_id": rid, "dtrain.run_dir": str(Path(run_dir).resolve())}
            run = self.client.create_run(exp_id, run_name=cfg.run_name or name, tags=tags)
            self.run_id = run.info.run_id

    def start(self, hparams: dict, config: dict) -> None:
        from mlflow.entities import Param

        if not self.resumed:  # MLflow refuses a param logged twice with another value
            params = [Param(k, str(v)) for k, v in hparams.items()]
            self.client.log_batch(self.run_id, params=params)
        self.client.log_dict(self.run_id, config, "config.json")

    def scalars(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _finite(values).items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def figure(self, tag: str, fig, step: int) -> None:
        self.client.log_figure(self.run_id, fig, f"{tag.replace('/', '_')}.png")

    def summary(self, final: dict) -> None:
        self.scalars(int(final.get("steps", 0)), {f"summary/{k}": v for k, v in final.items()})
        self.client.log_text(self.run_id, json.dumps(final, indent=1), "summary.json")

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def build_loggers(cfg: MetricsConfig, run_dir: Path, name: str) -> list:
    """The loggers metrics.wandb / metrics.mlflow turn on (call on rank 0 only)."""
    out: list = []
    if cfg.wandb.enabled and cfg.wandb.mode != "disabled":
        out.append(WandbLogger(cfg.wandb, run_dir, name))
    if cfg.mlflow.enabled:
        out.append(MlflowLogger(cfg.mlflow, run_dir, name))
    return out
