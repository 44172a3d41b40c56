"""Runs side by side: one table (speed, memory, the final training and eval losses, each data
source's eval loss) and one chart of memory per GPU, predicted beside measured.

    python -m dtrain.cli.compare outputs/ddp-bf16-w2-1b outputs/fsdp-bf16-w2-1b png=mem.png
    python -m dtrain.cli.compare multirun/2026-11-26_04-00-00/*      # a whole sweep, table only
    python -m dtrain.cli.compare runs=[RUN_A,RUN_B] markdown=true

Run dirs are given bare or as runs=[...]; options are key=value (the older --png PATH,
--markdown, --json and --no-png still work). The table goes to stdout; a chart is written only
where png=PATH names it (an existing file is replaced only with overwrite=true, a symbolic link
there never written through), and its path is printed last, on stderr.

Reads each run dir's metrics.jsonl (or, without one, its TensorBoard event files). Throughput
and MFU are averaged over the logged intervals after the first (which holds compilation and
warm-up). Measured memory is the worst rank's: peak reserved on CUDA; on CPU, where RSS
describes the process rather than the plan, the exact model-state bytes (params + grads +
optimizer states), compared with the predicted model state.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
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
    path = run_dir / "metrics.jsonl"
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        except RecursionError:  # nested deeper than any record dtrain writes
            print(f"warning: {path}:{n} is nested too deeply; skipped", file=sys.stderr)
            continue
        if isinstance(record, dict):
            b.add(record)
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
    for tag, series in values.items():
        m = re.fullmatch(r"eval/([^/]+)/loss", tag)
        if m and series:
            b.s.final_eval_sources[m.group(1)] = series[-1]
    b.tok = values.get("perf/tokens_per_s_per_gpu", [])
    b.mfu = values.get("perf/mfu", [])
    prefix = "eval/downstream/"
    b.s.downstream = {t[len(prefix) :]: v[-1] for t, v in values.items() if t.startswith(prefix)}
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


def _loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


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
        "eval loss",
    ]
    # each data source's eval loss, in one column per source any run has
    sources = list(dict.fromkeys(n for r in runs for n in r.final_eval_sources))
    head += [f"eval {n}" for n in sources]
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
                _loss(r.final_loss),
                _loss(r.final_eval_loss),
                *(_loss(r.final_eval_sources.get(n)) for n in sources),
            ]
        )
        if speed:
            p, e = r.predicted_tokens_per_s_per_gpu, r.speed_error_pct
            rows[-1][6:6] = ["-" if p is None else f"{p:,.0f}", "-" if e is None else f"{e:+.1f}%"]
    add_downstream(runs, head, rows)
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


def add_downstream(runs: list[RunSummary], head: list[str], rows: list[list[str]]) -> None:
    """A column per downstream task any run scored: its last acc and acc_norm."""
    tasks = sorted({k.rsplit("/", 1)[0] for r in runs for k in r.downstream})
    for task in tasks:
        head.append(f"{task} acc/norm")
        for r, row in zip(runs, rows):
            acc, norm = r.downstream.get(f"{task}/acc"), r.downstream.get(f"{task}/acc_norm")
            row.append(
                "-" if acc is None else f"{acc:.3f}/" + ("-" if norm is None else f"{norm:.3f}")
            )


def write_chart(runs: list[RunSummary], path: Path, overwrite: bool = False) -> None:
    """Per run: the predicted breakdown stacked, and the measured bar beside it."""
    from dtrain.errors import ConfigError
    from dtrain.reliability.safe_write import staged

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("the chart needs matplotlib: pip install 'dtrain[plot]'") from None
    fig = draw_chart(runs)
    try:
        with staged(path, overwrite=overwrite, key="png") as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    except ConfigError as e:  # an unwritable folder, a full disk: nothing half-written stays
        raise ConfigError(f"png={path}: cannot write the chart ({e})") from None
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def check_png_path(path: Path, overwrite: bool = False) -> None:
    """Refuse a png= path the chart could not (or must not) replace, before any run is read."""
    from dtrain.errors import ConfigError
    from dtrain.reliability.safe_write import exists_message, refuse_link

    refuse_link(path, f"png={path}")
    if path.is_dir():
        raise ConfigError(
            f"png={path} is a directory; give a file name, e.g. png={path / 'memory.png'}"
        )
    if path.exists() and not overwrite:
        raise ConfigError(exists_message(path, "png"))


@dataclass
class CompareArgs:
    runs: list[str] = field(default_factory=list)  # run dirs (also accepted bare)
    png: str | None = None  # write the memory chart here
    overwrite: bool = False  # replace an existing png
    markdown: bool = False  # the table in markdown
    json: bool = False  # one JSON object per run instead of the table


OLD_FLAGS = {"--markdown": "markdown=true", "--json": "json=true", "--no-png": None}


def parse_args(argv: list[str]) -> CompareArgs:
    """key=value options; bare arguments are run dirs; the older flags are translated."""
    from dtrain.cli._kv import exit_with_help_if_asked, parse_kv
    from dtrain.errors import ConfigError

    exit_with_help_if_asked(argv, "python -m dtrain.cli.compare", __doc__, CompareArgs)
    keys = {f"{k}=" for k in CompareArgs.__dataclass_fields__}
    kv, runs = [], []
    it = iter(argv)
    for arg in it:
        if arg == "--png":
            kv.append(f"png={next(it, '')}")
        elif arg.startswith("--png="):
            kv.append("png=" + arg[len("--png=") :])
        elif arg in OLD_FLAGS:
            if OLD_FLAGS[arg]:
                kv.append(OLD_FLAGS[arg])
        elif any(arg.startswith(k) for k in keys):
            kv.append(arg)
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; valid keys: {', '.join(sorted(keys))}")
        else:
            runs.append(arg)
    args = parse_kv(CompareArgs, kv)
    args.runs = [str(r) for r in args.runs] + runs
    if not args.runs:
        raise ConfigError("no run dirs given; e.g. python -m dtrain.cli.compare outputs/RUN")
    if args.png == "":
        raise ConfigError("png= needs a file name, e.g. png=memory.png")
    return args


def main(argv: list[str] | None = None) -> int:
    from dtrain.errors import UserError, fail

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        png = Path(args.png) if args.png else None
        if png is not None:
            check_png_path(png, args.overwrite)
        runs = [read_run(d) for d in args.runs]
        if args.json:
            for r in runs:
                print(json.dumps({**r.__dict__, "error_pct": r.error_pct}))
        else:
            print(render_table(runs, markdown=args.markdown))
        if png is not None:
            write_chart(runs, png, overwrite=args.overwrite)
            print(f"chart: {png}", file=sys.stderr)
    except UserError as e:
        fail(e, rank0_only=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
