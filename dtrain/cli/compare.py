"""Runs side by side: one table and one chart of memory per GPU, predicted beside measured.

    python -m dtrain.cli.compare outputs/ddp-bf16-w2-1b outputs/fsdp-bf16-w2-1b --png mem.png
    python -m dtrain.cli.compare multirun/2026-11-26_04-00-00/*      # a whole sweep

The chart goes beside its inputs unless --png names it: RUN_DIR/compare_memory.png for one run,
the run dirs' common parent folder for several (the first run dir when they share only the
filesystem root); its path is printed last, on stderr.

Reads each run dir's metrics.jsonl (or, without one, its TensorBoard event files). Throughput
and MFU are averaged over the logged intervals after the first (which holds compilation and
warm-up). Measured memory is the worst rank's: peak reserved on CUDA; on CPU, where RSS
describes the process rather than the plan, the exact model-state bytes (params + grads +
optimizer states), compared with the predicted model state.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

PARTS = ("params", "grads", "optim", "activations", "transient", "overhead")


@dataclass
class RunSummary:
    run_dir: str
    strategy: str = "?"
    precision: str = "?"
    world_size: int = 1
    model: str = "?"
    device: str = "?"
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    final_loss: float | None = None
    measured_bytes: int | None = None  # worst rank: peak reserved (CUDA) or model state (CPU)
    predicted_bytes: int | None = None  # the same quantity, predicted
    measured_kind: str = "peak_reserved"  # or model_state
    predicted_parts: dict[str, int] = field(default_factory=dict)

    @property
    def error_pct(self) -> float | None:
        if not self.measured_bytes or self.predicted_bytes is None:
            return None
        return 100.0 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _steady(records: list[dict]) -> list[dict]:
    """Logged intervals after the first (compilation, allocator warm-up, lazy optimizer state)."""
    return records[1:] if len(records) > 1 else records


def _from_hydra(run_dir: Path, s: RunSummary) -> None:
    """Fill run identity from Hydra's saved config when metrics.jsonl has no `run` record."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return
    from omegaconf import OmegaConf

    from dtrain.errors import DataError

    try:  # OmegaConf's loader is yaml's safe one: a python/object tag is an error, never code
        c = OmegaConf.load(path)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path} is not a plain YAML config: {first}") from None
    s.strategy = str(OmegaConf.select(c, "strategy.name", default=s.strategy))
    s.precision = str(OmegaConf.select(c, "precision.name", default=s.precision))
    s.model = str(OmegaConf.select(c, "model.name", default=s.model))


def _apply_memory(s: RunSummary, pred: dict | None, mem_per_rank_records: list[list[dict]]):
    """Measured worst-rank memory and the matching predicted quantity and breakdown."""
    ranks = [m for rec in mem_per_rank_records for m in rec]
    if any("peak_reserved_bytes" in m for m in ranks):
        s.measured_kind = "peak_reserved"
        s.measured_bytes = max(m.get("peak_reserved_bytes", 0) for m in ranks)
        if pred:
            s.predicted_bytes = pred.get("peak_bytes")
            parts = dict(pred.get("at_peak", {}))
            parts["overhead"] = parts.get("overhead", 0) - pred.get("context_bytes", 0)
            s.predicted_parts = {k: int(parts.get(k, 0)) for k in PARTS}
    elif ranks:
        s.measured_kind = "model_state"
        s.measured_bytes = max(
            sum(m.get(k, 0) for k in ("params_bytes", "grads_bytes", "optim_bytes", "master_bytes"))
            for m in ranks
        )
        if pred:
            s.predicted_bytes = pred.get("model_state_bytes")
            s.predicted_parts = {
                "params": pred.get("params_bytes", 0),
                "grads": pred.get("grads_bytes", 0),
                "optim": pred.get("optim_bytes", 0) + pred.get("master_bytes", 0),
            }


def read_jsonl_run(run_dir: Path) -> RunSummary:
    s = RunSummary(str(run_dir))
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    pred = None
    for r in records:
        if "run" in r:
            info = r["run"]
            s.strategy, s.precision = info.get("strategy", "?"), info.get("precision", "?")
            s.world_size, s.model = int(info.get("world_size", 1)), info.get("model", "?")
            s.device = info.get("device", "?")
        if "memory_predicted" in r:
            pred = r["memory_predicted"]
    if s.strategy == "?":
        _from_hydra(run_dir, s)
    train = [r for r in records if "loss" in r]
    if train:
        s.final_loss = train[-1]["loss"]
        steady = _steady(train)
        s.tokens_per_s_per_gpu = _mean([r.get("tokens_per_s_per_gpu") for r in steady])
        s.mfu = _mean([r.get("mfu") for r in steady])
        if s.world_size == 1 and train[-1].get("memory_per_rank"):
            s.world_size = len(train[-1]["memory_per_rank"])
    _apply_memory(s, pred, [r["memory_per_rank"] for r in train if r.get("memory_per_rank")])
    return s


def read_event_run(run_dir: Path) -> RunSummary:
    """The same summary from TensorBoard event files (scalars only)."""
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])

    def values(tag: str) -> list[float]:
        return [e.value for e in acc.Scalars(tag)] if tag in tags else []

    s = RunSummary(str(run_dir))
    _from_hydra(run_dir, s)
    loss = values("train/loss")
    s.final_loss = loss[-1] if loss else None
    s.tokens_per_s_per_gpu = _mean(_steady(values("perf/tokens_per_s_per_gpu")))
    s.mfu = _mean(_steady(values("perf/mfu")))
    per_rank: dict[int, dict] = {}
    for tag in tags:
        m = re.fullmatch(r"memory/rank(\d+)/(\w+)", tag)
        if m:
            per_rank.setdefault(int(m.group(1)), {})[m.group(2)] = int(max(values(tag)))
    s.world_size = max(1, len(per_rank))
    pred = None
    if "memory/predicted/total_bytes" in tags:
        pred = {
            t.split("/")[-1]: int(values(t)[-1]) for t in tags if t.startswith("memory/predicted/")
        }
        pred["at_peak"] = {k: pred.get(f"at_peak_{k}", 0) for k in PARTS}
    _apply_memory(s, pred, [list(per_rank.values())])
    return s


def read_run(run_dir: str | Path) -> RunSummary:
    from dtrain.errors import DataError

    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").exists():
        return read_jsonl_run(run_dir)
    if (run_dir / "tensorboard").is_dir():
        return read_event_run(run_dir)
    raise DataError(f"{run_dir} is not a run dir: it has neither metrics.jsonl nor tensorboard/")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**3:.2f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**2:.2f}"


def render_table(runs: list[RunSummary], markdown: bool = False) -> str:
    """One row per run. Memory in GiB on CUDA, MiB for CPU model-state comparisons."""
    cpu = all(r.measured_kind == "model_state" for r in runs)
    unit, fmt = ("MiB", _mib) if cpu else ("GiB", _gib)
    what = "model state" if cpu else "peak reserved"
    head = [
        "run",
        "strategy",
        "precision",
        "world",
        "model",
        "tok/s/GPU",
        "MFU",
        f"measured {what} ({unit})",
        f"predicted ({unit})",
        "error",
        "final loss",
    ]
    rows = []
    for r in runs:
        err = r.error_pct
        rows.append(
            [
                Path(r.run_dir).name,
                r.strategy,
                r.precision,
                str(r.world_size),
                r.model,
                "-" if r.tokens_per_s_per_gpu is None else f"{r.tokens_per_s_per_gpu:,.0f}",
                "-" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                fmt(r.measured_bytes),
                fmt(r.predicted_bytes),
                "-" if err is None else f"{err:+.1f}%",
                "-" if r.final_loss is None else f"{r.final_loss:.4f}",
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells: list[str]) -> str:  # names left-aligned, numbers right-aligned
        return "  ".join(
            c.rjust(w) if i > 4 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_chart(runs: list[RunSummary], path: Path) -> None:
    """Per run: the predicted breakdown stacked, and the measured bar beside it."""
    from dtrain.errors import ConfigError

    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "the chart needs matplotlib: pip install 'dtrain[plot]' (or pass --no-png)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cpu = all(r.measured_kind == "model_state" for r in runs)
    scale, unit = (1024**2, "MiB") if cpu else (1024**3, "GiB")
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
    tmp = path.with_name(path.name + ".tmp.png")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=120)
        tmp.replace(path)
    except OSError as e:  # an unwritable folder, a full disk: nothing half-written stays
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"--png {path}: cannot write the chart ({e})") from None
    finally:
        plt.close(fig)


def check_png_path(path: Path) -> None:
    """Refuse a --png path the chart could not replace, before any run is read."""
    from dtrain.errors import ConfigError

    if path.is_dir():
        raise ConfigError(
            f"--png {path} is a directory; give a file name, e.g. --png {path / 'memory.png'}"
        )


CHART_NAME = "compare_memory.png"


def default_png(run_dirs: list[str]) -> Path:
    """Beside the inputs, not in the current directory: the folder the runs share."""
    dirs = [Path(d).resolve() for d in run_dirs]
    common = Path(os.path.commonpath(dirs))
    if common == Path(common.anchor):  # runs that share only / or a drive: no place of theirs
        common = dirs[0]
    return common / CHART_NAME


def main(argv: list[str] | None = None) -> int:
    from dtrain.errors import UserError, fail

    ap = argparse.ArgumentParser(prog="python -m dtrain.cli.compare", description=__doc__)
    ap.add_argument("run_dirs", nargs="+", help="run directories (metrics.jsonl or tensorboard/)")
    ap.add_argument("--png", default=None, help="chart path (default: beside the run dirs)")
    ap.add_argument("--no-png", action="store_true", help="print the table only")
    ap.add_argument("--markdown", action="store_true", help="the table in markdown")
    ap.add_argument("--json", action="store_true", help="one JSON object per run instead")
    args = ap.parse_args(argv)
    png = Path(args.png) if args.png else default_png(args.run_dirs)
    try:
        if not args.no_png:
            check_png_path(png)
        runs = [read_run(d) for d in args.run_dirs]
        if args.json:
            for r in runs:
                print(json.dumps({**r.__dict__, "error_pct": r.error_pct}))
        else:
            print(render_table(runs, markdown=args.markdown))
        if not args.no_png:
            write_chart(runs, png)
            print(f"chart: {png}", file=sys.stderr)
    except UserError as e:
        fail(e, rank0_only=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
