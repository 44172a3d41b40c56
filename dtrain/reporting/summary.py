"""A run in a few numbers, from its metrics.jsonl records, and compare's chart.

The same summary is what `dtrain.cli.compare` prints per run and what a run hands its loggers
at the end (TensorBoard's text summary, W&B's run summary, MLflow's summary metrics), so the
numbers agree wherever they are read. Throughput and MFU are averaged over the logged intervals
after the first (which holds compilation and warm-up). Measured memory is the worst rank's: peak
reserved on CUDA; on CPU, where RSS describes the process rather than the plan, the exact
model-state bytes (params + grads + optimizer states), compared with the predicted model state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1024**3
PARTS = ("params", "grads", "optim", "activations", "transient", "overhead")
STATE_KEYS = ("params_bytes", "grads_bytes", "optim_bytes", "master_bytes")
PREDICTED_SPEED_KEY = "predicted_tokens_per_s_per_gpu"  # = dtrain.memory.PREDICTED_SPEED_KEY


@dataclass
class RunSummary:
    run_dir: str
    strategy: str = "?"
    precision: str = "?"
    world_size: int = 1
    model: str = "?"
    device: str = "?"
    steps: int = 0
    tokens_per_s_per_gpu: float | None = None
    # The speed plan's figure (metrics.jsonl key `predicted_tokens_per_s_per_gpu`, logged by
    # runs that know their GPU: dtrain.memory.run_speed_prediction).
    predicted_tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    final_loss: float | None = None
    final_eval_loss: float | None = None
    # each source of a data mixture: its last eval loss (eval/<source>/loss)
    final_eval_sources: dict[str, float] = field(default_factory=dict)
    measured_bytes: int | None = None  # worst rank: peak reserved (CUDA) or model state (CPU)
    predicted_bytes: int | None = None  # the same quantity, predicted
    measured_kind: str = "peak_reserved"  # or model_state
    predicted_parts: dict[str, int] = field(default_factory=dict)
    # The last downstream scores: {"<task>/acc": ..., "<task>/acc_norm": ...}
    downstream: dict[str, float] = field(default_factory=dict)

    @property
    def speed_error_pct(self) -> float | None:
        """100 x (predicted - measured) / measured tokens/s per GPU."""
        if not self.tokens_per_s_per_gpu or self.predicted_tokens_per_s_per_gpu is None:
            return None
        measured = self.tokens_per_s_per_gpu
        return 100.0 * (self.predicted_tokens_per_s_per_gpu - measured) / measured

    @property
    def error_pct(self) -> float | None:
        if not self.measured_bytes or self.predicted_bytes is None:
            return None
        return 100.0 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    def final(self) -> dict:
        """The run's final numbers under flat names, None left out (for the loggers)."""
        kind = self.measured_kind
        out = {
            "steps": self.steps,
            "final_loss": self.final_loss,
            "final_eval_loss": self.final_eval_loss,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "predicted_tokens_per_s_per_gpu": self.predicted_tokens_per_s_per_gpu,
            "speed_prediction_error_pct": self.speed_error_pct,
            "mfu": self.mfu,
            f"measured_{kind}_gib": _gib(self.measured_bytes),
            f"predicted_{kind}_gib": _gib(self.predicted_bytes),
            f"prediction_error_pct_{kind}": self.error_pct,
            **{f"downstream/{k}": v for k, v in self.downstream.items()},
        }
        return {k: v for k, v in out.items() if v is not None}


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def steady(xs: list) -> list:
    """Logged intervals after the first (compilation, allocator warm-up, lazy optimizer state)."""
    return xs[1:] if len(xs) > 1 else xs


class SummaryBuilder:
    """Reads metrics.jsonl records one at a time (from the file, or as a run writes them)."""

    def __init__(self, run_dir: str | Path):
        self.s = RunSummary(str(run_dir))
        self.pred: dict | None = None
        self.tok: list = []
        self.mfu: list = []
        self.peak_reserved: int | None = None  # the worst rank's, over the run
        self.model_state: int | None = None
        self.ranks_seen = 0

    def add(self, r: dict) -> None:
        s = self.s
        if "run" in r:
            info = r["run"]
            s.strategy, s.precision = info.get("strategy", "?"), info.get("precision", "?")
            s.world_size, s.model = int(info.get("world_size", 1)), info.get("model", "?")
            s.device = info.get("device", "?")
        if "memory_predicted" in r:
            self.pred = r["memory_predicted"]
        if r.get(PREDICTED_SPEED_KEY) is not None:  # the step-0 record, or every logged step
            s.predicted_tokens_per_s_per_gpu = r[PREDICTED_SPEED_KEY]
        if "eval_loss" in r:
            s.final_eval_loss = r["eval_loss"]
        for name, ev in (r.get("eval_sources") or {}).items():
            s.final_eval_sources[name] = ev["loss"]
        if isinstance(r.get("downstream"), dict):  # a later scoring replaces an earlier one
            s.downstream = {
                str(k): float(v) for k, v in r["downstream"].items() if isinstance(v, int | float)
            }
        if "loss" not in r:
            return
        s.final_loss, s.steps = r["loss"], r.get("step", s.steps)
        self.tok.append(r.get("tokens_per_s_per_gpu"))
        self.mfu.append(r.get("mfu"))
        self.add_memory(r.get("memory_per_rank") or [])

    def add_memory(self, ranks: list[dict]) -> None:
        self.ranks_seen = max(self.ranks_seen, len(ranks))
        for m in ranks:
            if "peak_reserved_bytes" in m:
                self.peak_reserved = max(self.peak_reserved or 0, m["peak_reserved_bytes"])
            state = sum(m.get(k, 0) for k in STATE_KEYS)
            self.model_state = max(self.model_state or 0, state)

    def result(self) -> RunSummary:
        s = self.s
        s.tokens_per_s_per_gpu = mean(steady(self.tok))
        s.mfu = mean(steady(self.mfu))
        if s.world_size == 1 and self.ranks_seen:
            s.world_size = self.ranks_seen
        pred = self.pred or {}
        if self.peak_reserved is not None:
            s.measured_kind, s.measured_bytes = "peak_reserved", self.peak_reserved
            if self.pred:
                s.predicted_bytes = pred.get("peak_bytes")
                parts = dict(pred.get("at_peak", {}))
                parts["overhead"] = parts.get("overhead", 0) - pred.get("context_bytes", 0)
                s.predicted_parts = {k: int(parts.get(k, 0)) for k in PARTS}
        elif self.model_state is not None:
            s.measured_kind, s.measured_bytes = "model_state", self.model_state
            if self.pred:
                s.predicted_bytes = pred.get("model_state_bytes")
                s.predicted_parts = {
                    "params": pred.get("params_bytes", 0),
                    "grads": pred.get("grads_bytes", 0),
                    "optim": pred.get("optim_bytes", 0) + pred.get("master_bytes", 0),
                }
        return s


def draw_chart(runs: list[RunSummary]):
    """Per run: the predicted breakdown stacked, and the measured bar beside it. Returns a
    matplotlib Figure (the caller saves or logs it, then closes it); ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cpu = all(r.measured_kind == "model_state" for r in runs)
    scale, unit = (1024**2, "MiB") if cpu else (GiB, "GiB")
    colors = dict(zip(PARTS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(runs) + 2), 4.8))
    width, labelled = 0.38, set()

    def label(name: str) -> str | None:
        # One legend entry per part, however many runs draw it.
        if name in labelled:
            return None
        labelled.add(name)
        return name

    for i, r in enumerate(runs):
        bottom = 0.0
        for part in PARTS:
            v = r.predicted_parts.get(part, 0) / scale
            if v > 0:
                ax.bar(i - width / 2, v, width, bottom=bottom, color=colors[part],
                       label=label(f"predicted: {part}"))  # fmt: skip
                bottom += v
        if not r.predicted_parts and r.predicted_bytes:  # event files hold the total only
            ax.bar(i - width / 2, r.predicted_bytes / scale, width, color="#8c8c8c",
                   label=label("predicted"))  # fmt: skip
        if r.measured_bytes:
            ax.bar(i + width / 2, r.measured_bytes / scale, width, color="#333333",
                   label=label("measured"))  # fmt: skip
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(
        [f"{r.strategy}\n{r.precision}\nw{r.world_size} {r.model}" for r in runs], fontsize=8
    )
    what = "model state (params + grads + optim)" if cpu else "peak reserved"
    ax.set_ylabel(f"{unit} per GPU")
    ax.set_title(f"Memory per GPU (worst rank): predicted vs measured\n{what}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def run_hparams(
    cfg,
    *,
    strategy: str,
    precision: str,
    env,
    grad_accum_steps: int,
    n_params: int,
    compile_enabled: bool,
) -> dict:
    """What tells this run from others: TensorBoard's HParams, W&B's config, MLflow's params
    and metrics.jsonl's `run` record. Plain str / int / float / bool values only."""
    import torch

    t = cfg.trainer
    global_batch = t.micro_batch_size * grad_accum_steps * env.world_size
    cuda = env.device.type == "cuda"
    return {
        "strategy": strategy,
        "precision": precision,
        "world_size": env.world_size,
        "model": cfg.model.name,
        "n_params": n_params,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum_steps": grad_accum_steps,
        "global_batch_size": global_batch,
        "seq_len": t.seq_len,
        "lr": cfg.optim.lr,
        "data": cfg.data.name,
        "device": env.device.type,
        "gpu": torch.cuda.get_device_name(env.device) if cuda else "cpu",
        "compile": compile_enabled,
    } | precision_choices(cfg.precision)


def precision_choices(p) -> dict:
    """The precision's own choices (precision.int8_* for int8, precision.fp8_* for fp8) and the
    8-bit optimizer, as `precision.<key>`: two int8 runs with other kernels tell apart."""
    from dtrain.config import PRECISION_OWN_KEYS

    own = p.name.split("-")[0] + "_"
    keys = [k for k in PRECISION_OWN_KEYS if k.startswith(own)] + ["optimizer_8bit"]
    values = {k: getattr(p, k, None) for k in keys}
    return {f"precision.{k}": v for k, v in values.items() if isinstance(v, str | int | float)}
