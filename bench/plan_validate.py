"""Predicted vs measured tokens/s per GPU over a grid of real runs.

    python bench/plan_validate.py --out $OUT                       # 1b and 8b, 1 and 2 GPUs
    python bench/plan_validate.py --out $OUT --profile $OUT/profile.json  # and a profile
    python bench/plan_validate.py --out /tmp/pv --smoke            # CPU, tiny (tests run this)
    python bench/plan_validate.py --out $OUT --from-runs RUN_DIR...  # runs made for other ends

With --from-runs no run is made: each given run dir's own logged prediction (every run on a known
GPU logs `predicted_tokens_per_s_per_gpu`, datasheet figures) is set beside its measured speed,
so the runs of other benchmarks (bench/lowp.sh, bench/launch_times.py, ...) count as points.

Each point trains a few compiled steps through the real trainer (bench/memory_check.py's
run_point: synthetic data, torchrun for 2+ GPUs) and its measured tokens/s per GPU (the mean of
the logged intervals after the first) is set beside the speed plan's prediction for the same
configuration (dtrain.memory.run_speed_prediction, datasheet figures; and the profile's with
--profile). The summary: how many points are within ±15%, and, per model and GPU count, whether
the configuration the plan ranks first is within 5% of the fastest one measured.

Shapes: model=1b at micro-batch 8 x 2048 (vocab 50304), model=8b at 1 x 8192 (vocab 128256),
as in docs/benchmarks.md. Writes OUT/plan_validate.json and OUT/plan_validate.md; one run dir
and log per point.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# model -> (micro-batch, seq_len, vocab): the shapes of docs/benchmarks.md
SHAPES = {"1b": (8, 2048, 50304), "8b": (1, 8192, 128256), "tiny": (4, 64, 512)}
PREDICTED = "predicted_tokens_per_s_per_gpu"  # what a run on a known GPU logs (metrics.jsonl)
SPEED_BAND = 0.15  # the goal: predicted within ±15% of measured
PICK_BAND = 0.05  # the plan's first pick within 5% of the fastest measured


def grid(models: str, strategies: str, precisions: str, nprocs: str) -> list[dict]:
    """single on one GPU, the multi-rank strategies on more; each strategy with the precisions
    it declares (DeepSpeed's take no fp8 or int8: a run would only stop on the config error)."""
    from dtrain.strategies import STRATEGIES

    points = []
    for model in models.split(","):
        for nproc in (int(n) for n in nprocs.split(",")):
            for strategy in strategies.split(","):
                if (strategy == "single") != (nproc == 1):
                    continue
                for precision in precisions.split(","):
                    if precision not in STRATEGIES[strategy].precisions:
                        continue
                    points.append(
                        {
                            "model": model,
                            "strategy": strategy,
                            "precision": precision,
                            "nproc": nproc,
                        }
                    )
    return points


def rows_from_runs(run_dirs: list[str]) -> list[dict]:
    """One row per run dir, from what its metrics.jsonl holds: the `run` record (model,
    strategy, precision, world size, card, batch shape), the logged prediction, and the
    median tokens/s per GPU of the logged intervals after the first (compile and warm-up; a
    later recompile is an outlier the median leaves out). Runs with no prediction (CPU, an
    unknown card) or no interval after the first are listed, marked, not scored."""
    rows = []
    for d in run_dirs:
        recs = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines() if x]
        run = next((r["run"] for r in recs if "run" in r), {})
        predicted = next(
            (r[PREDICTED] for r in recs if r.get(PREDICTED) is not None and "loss" not in r), None
        )
        steady = [r["tokens_per_s_per_gpu"] for r in recs if "loss" in r][1:]
        measured = statistics.median(steady) if steady else None
        world = int(run.get("world_size", 1))
        rows.append(
            {
                "name": Path(d).name,
                "run_dir": str(d),
                "model": run.get("model", "?"),
                "strategy": run.get("strategy", "?"),
                "precision": run.get("precision", "?"),
                "nproc": world,
                "gpu": run.get("gpu", "?"),
                # picks compare runs of one model, world size, card and sequence length (one
                # job); the micro-batch is one of the plan's choices (objective=fastest), so
                # runs at different ones compete
                "group": f"{run.get('model', '?')} x{world} {run.get('gpu', '?')} "
                f"seq {run.get('seq_len', '?')}",
                "micro_batch_size": run.get("micro_batch_size"),
                "tokens_per_s_per_gpu": measured,
                "predicted_tokens_per_s_per_gpu": predicted,
                "status": "ok"
                if measured and predicted is not None
                else "no prediction or no interval after the first",
            }
        )
    return rows


def point_args(args, model: str):
    """bench/memory_check.py's arguments for one model's shape."""
    a = copy.copy(args)
    a.micro_batch, a.seq_len, a.vocab = SHAPES.get(model, SHAPES["1b"])
    return a


def predict(p: dict, args, profile: str | None) -> float | None:
    """The speed plan's tokens/s per GPU for a point, on args.gpu's figures (and a profile)."""
    from dtrain.config import compose
    from dtrain.hardware import GPUS
    from dtrain.memory import run_speed_prediction

    a = point_args(args, p["model"])
    cfg = compose(
        [
            f"model={p['model']}",
            f"strategy={p['strategy']}",
            f"precision={p['precision']}",
            "data=synthetic",
            f"data.vocab_size={a.vocab}",
            f"trainer.micro_batch_size={a.micro_batch}",
            f"trainer.seq_len={a.seq_len}",
            *args.extra,
        ]
    )
    speed = run_speed_prediction(
        cfg, p["nproc"], "cuda", gpu=GPUS[args.gpu], profile=profile or "none", compile_enabled=True
    )
    return None if speed is None else speed.tokens_per_s_per_gpu


def summarize(rows: list[dict], key: str = "predicted_tokens_per_s_per_gpu") -> dict:
    """Hit rate within ±SPEED_BAND, and per (model, GPUs) whether the plan's first pick among
    the measured points is within PICK_BAND of the fastest measured."""
    ok = [r for r in rows if r.get("tokens_per_s_per_gpu") and r.get(key)]
    for r in ok:
        r[key.replace("tokens_per_s_per_gpu", "error_pct")] = 100 * (
            r[key] / r["tokens_per_s_per_gpu"] - 1
        )
    within = [r for r in ok if abs(r[key] / r["tokens_per_s_per_gpu"] - 1) <= SPEED_BAND]
    groups: dict[str, list[dict]] = {}
    for r in ok:
        groups.setdefault(r.get("group") or f"{r['model']} x{r['nproc']}", []).append(r)
    picks = {}
    for g, rs in groups.items():
        pick = max(rs, key=lambda r: r[key])
        best = max(rs, key=lambda r: r["tokens_per_s_per_gpu"])
        ratio = pick["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]
        picks[g] = {
            "pick": pick["name"],
            "fastest": best["name"],
            "ratio": ratio,
            "within": ratio >= 1 - PICK_BAND,
        }
    return {
        "points": len(ok),
        "within_band": len(within),
        "hit_rate": len(within) / len(ok) if ok else None,
        "goal_met": bool(ok) and len(within) >= 0.8 * len(ok),
        "picks": picks,
        "picks_met": all(p["within"] for p in picks.values()) if picks else None,
    }


def markdown(rows: list[dict], summaries: dict, args, device: str) -> str:
    how = (
        "the runs' own logged predictions"
        if args.from_runs
        else f"{args.steps} steps a point, compile={args.compile}"
    )
    lines = [
        f"Predicted vs measured tokens/s per GPU. Card: {device} (planned as {args.gpu}). "
        f"Date: {datetime.date.today().isoformat()}. {how}.",
        "",
        f"Command: `python bench/plan_validate.py {' '.join(sys.argv[1:])}`",
        "",
        "| run | model | strategy | precision | GPUs | micro-batch | measured "
        "| predicted (datasheet) | error | predicted (profile) | error | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cell = lambda x, f: "-" if x is None else f.format(x)  # noqa: E731
    for r in rows:
        lines.append(
            # the run dir's name tells runs of one precision apart (options such as
            # precision.optimizer_8bit are in the name, not in the columns)
            f"| {r.get('name', '-')} | {r['model']} | {r['strategy']} | {r['precision']} | "
            f"{r['nproc']} | "
            f"{r.get('micro_batch_size') or '-'} | "
            f"{cell(r.get('tokens_per_s_per_gpu'), '{:,.0f}')} | "
            f"{cell(r.get('predicted_tokens_per_s_per_gpu'), '{:,.0f}')} | "
            f"{cell(r.get('predicted_error_pct'), '{:+.1f}%')} | "
            f"{cell(r.get('profile_tokens_per_s_per_gpu'), '{:,.0f}')} | "
            f"{cell(r.get('profile_error_pct'), '{:+.1f}%')} | {r['status']} |"
        )
    for what, s in summaries.items():
        if not s["points"]:
            continue
        lines += [
            "",
            f"{what}: {s['within_band']} of {s['points']} points within "
            f"±{SPEED_BAND:.0%} (goal 80%: {'met' if s['goal_met'] else 'missed'}).",
        ]
        for g, p in s["picks"].items():
            lines.append(
                f"- {g}: the plan's pick {p['pick']} ran at {p['ratio']:.1%} of the "
                f"fastest, {p['fastest']} ({'within' if p['within'] else 'outside'} "
                f"{PICK_BAND:.0%})"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from memory_check import run_point

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results directory ($OUT)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few seconds a point")
    ap.add_argument("--models", default=None, help="default 1b,8b (smoke: tiny)")
    ap.add_argument("--strategies", default="single,ddp,fsdp,zero2,zero3")
    ap.add_argument("--precisions", default=None, help="default bf16,fp8 (smoke: fp32)")
    ap.add_argument("--nprocs", default="1,2", help="GPUs per point")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gpu", default=None, help="dtrain.hardware name (default: this card's)")
    ap.add_argument("--profile", default=None, help="a dtrain.cli.calibrate profile, predicted too")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per point")
    ap.add_argument("--from-runs", nargs="+", metavar="RUN_DIR", help="score these runs instead")
    ap.add_argument("extra", nargs="*", help="more overrides for every point")
    args = ap.parse_args(argv)
    if not args.out:
        ap.error("--out (or $OUT) is required")
    if args.from_runs:
        return write_from_runs(args)
    args.models = args.models or ("tiny" if args.smoke else "1b,8b")
    args.precisions = args.precisions or ("fp32" if args.smoke else "bf16,fp8")
    args.compile, args.all_pairs = not args.smoke, False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from dtrain.hardware import gpu_named

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA device; run with --smoke on CPU", file=sys.stderr)
        return 2
    spec = gpu_named(device) if device != "CPU" else None
    args.gpu = args.gpu or (spec.name if spec else "h100-80gb")
    rows = []
    for p in grid(args.models, args.strategies, args.precisions, args.nprocs):
        row = run_point(p, point_args(args, p["model"]), out)
        row["micro_batch_size"] = point_args(args, p["model"]).micro_batch
        row["predicted_tokens_per_s_per_gpu"] = predict(p, args, None)
        if args.profile:
            row["profile_tokens_per_s_per_gpu"] = predict(p, args, args.profile)
        rows.append(row)
        print(
            json.dumps(
                {
                    k: row.get(k)
                    for k in (
                        "name",
                        "status",
                        "tokens_per_s_per_gpu",
                        "predicted_tokens_per_s_per_gpu",
                    )
                }
            )
        )
    summaries = {"datasheet": summarize(rows)}
    if args.profile:
        summaries["profile"] = summarize(rows, "profile_tokens_per_s_per_gpu")
    (out / "plan_validate.json").write_text(
        json.dumps(
            {"device": device, "gpu": args.gpu, "rows": rows, "summary": summaries},
            indent=1,
            default=str,
        )
    )
    (out / "plan_validate.md").write_text(markdown(rows, summaries, args, device))
    print((out / "plan_validate.md").read_text())
    return 0


def write_from_runs(args) -> int:
    """--from-runs: the table and summary of runs already made (no GPU needed to score them)."""
    rows = rows_from_runs(args.from_runs)
    device = ", ".join(sorted({r["gpu"] for r in rows}))
    args.gpu = args.gpu or "as each run logged"
    summaries = {"datasheet": summarize(rows)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_validate.json").write_text(
        json.dumps({"device": device, "rows": rows, "summary": summaries}, indent=1, default=str)
    )
    (out / "plan_validate.md").write_text(markdown(rows, summaries, args, device))
    print((out / "plan_validate.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
