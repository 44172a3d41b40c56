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
import os
import sys
from pathlib import Path

from dtrain.reporting.summary import (
    PARTS,
    GiB,
    RunSummary,
    SummaryBuilder,
    draw_chart,
)

__all__ = ["PARTS", "RunSummary", "main", "read_run", "render_table", "write_chart"]


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


def read_jsonl_run(run_dir: Path) -> RunSummary:
    b = SummaryBuilder(run_dir)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            b.add(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    s = b.result()
    if s.strategy == "?":
        _from_hydra(run_dir, s)
    return s


def read_event_run(run_dir: Path) -> RunSummary:
    """The same summary from TensorBoard event files (scalars only; the predicted breakdown is
    in metrics.jsonl alone, so the chart shows the predicted total)."""
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtrain.reporting.tensorboard import event_dirs

    values: dict[str, list[float]] = {}
    for d in event_dirs(run_dir):  # one named run (two where an older run was resumed)
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            values.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))

    def in_bytes(tag: str, unit: str) -> int:  # GiB since runs were named, bytes before
        return int(round(max(values[tag]) * (GiB if unit == "gib" else 1)))

    b = SummaryBuilder(run_dir)
    loss = values.get("train/loss", [])
    b.s.final_loss = loss[-1] if loss else None
    eval_loss = values.get("eval/loss", [])
    b.s.final_eval_loss = eval_loss[-1] if eval_loss else None
    b.tok = values.get("perf/tokens_per_s_per_gpu", [])
    b.mfu = values.get("perf/mfu", [])
    per_rank: dict[int, dict] = {}
    pred: dict = {}
    for tag in values:
        m = re.fullmatch(r"memory/rank(\d+)/(\w+)_(bytes|gib)", tag)
        if m:
            per_rank.setdefault(int(m.group(1)), {})[m.group(2) + "_bytes"] = in_bytes(
                tag, m.group(3)
            )
        m = re.fullmatch(r"memory/predicted/(\w+)_(bytes|gib)", tag)
        if m:
            pred[m.group(1) + "_bytes"] = in_bytes(tag, m.group(2))
    for mem in per_rank.values():  # the per-rank model state is a sum of the parts below
        mem.pop("model_state_bytes", None)
    b.add_memory(list(per_rank.values()))
    if pred:
        pred["peak_bytes"] = pred.get("peak_reserved_bytes")
        b.pred = pred
    s = b.result()
    if "at_peak" not in pred:  # only the total was logged: no breakdown to stack
        s.predicted_parts = {}
    _from_hydra(run_dir, s)
    return s


def read_run(run_dir: str | Path) -> RunSummary:
    from dtrain.errors import DataError

    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").exists():
        return read_jsonl_run(run_dir)
    from dtrain.reporting.tensorboard import event_dirs

    if event_dirs(run_dir):
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
    speed = any(r.predicted_tokens_per_s_per_gpu is not None for r in runs)
    if speed:  # predicted beside measured throughput, where runs logged a prediction
        head[6:6] = ["predicted tok/s/GPU", "speed error"]
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
        if speed:
            p, e = r.predicted_tokens_per_s_per_gpu, r.speed_error_pct
            rows[-1][6:6] = ["-" if p is None else f"{p:,.0f}", "-" if e is None else f"{e:+.1f}%"]
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
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the chart needs matplotlib: pip install 'dtrain[plot]' (or pass --no-png)"
        ) from None
    fig = draw_chart(runs)
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
        import matplotlib.pyplot as plt

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
