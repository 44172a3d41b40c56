"""Predicted vs measured peak memory per GPU, for every strategy x precision x model x GPUs.

    python bench/memory_check.py --out $OUT                 # 1-2 GPUs, a few minutes
    python bench/memory_check.py --out /tmp/mc --smoke      # CPU, tiny model (a test runs it)

Each point trains a few steps with torchrun (synthetic data, so no data cost and a GPT-2-sized
vocab) and logs, through the normal training loop, the predicted memory (`memory_predicted`)
and the measured peak reserved memory of every rank (`memory_per_rank`). The table compares
the worst rank's peak reserved with the predicted peak reserved (the CUDA context is outside
both). On CPU it compares model-state bytes (params + grads + optimizer states), which must
match exactly.

Writes OUT/memory_check.md (the table, with the command and the card), OUT/memory_check.json,
OUT/memory_check.png (the chart of dtrain.cli.compare) and one run dir + log per point.
Points whose strategy is not available (not registered, or DeepSpeed missing) are listed as
such, not failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def point_command(overrides: list[str], nproc: int) -> list[str]:
    from dtrain.dist import train_command

    return train_command(overrides, nproc)


def grid(args) -> list[dict]:
    points = []
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            for nproc in (int(n) for n in args.nprocs.split(",")):
                for strategy in args.strategies.split(","):
                    # single runs on 1 GPU only; the others on several (and on 1 with
                    # --all-pairs).
                    if (strategy == "single") != (nproc == 1) and not (
                        args.all_pairs and nproc == 1
                    ):
                        continue
                    points.append(
                        {"model": model, "precision": precision, "nproc": nproc,
                         "strategy": strategy}
                    )  # fmt: skip
    return points


def run_point(p: dict, args, out: Path) -> dict:
    from dtrain.cli.compare import read_run

    name = f"{p['strategy']}-{p['precision']}-w{p['nproc']}-{p['model']}"
    run_dir = out / name
    if run_dir.exists():  # a previous check's run: metrics.jsonl would be appended to
        shutil.rmtree(run_dir)
    overrides = [
        f"model={p['model']}",
        f"strategy={p['strategy']}",
        f"precision={p['precision']}",
        "data=synthetic",
        f"data.vocab_size={args.vocab}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.max_steps={args.steps}",
        f"trainer.log_every={max(1, args.steps // 2)}",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "checkpoint.save_final=false",
        "resume=never",
        f"strategy.compile={'true' if args.compile else 'false'}",
        f"hydra.run.dir={run_dir}",
        *(["trainer.device=cpu", "data.max_bytes=300000"] if args.smoke else []),
        *args.extra,
    ]
    cmd = point_command(overrides, p["nproc"])
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    row = {**p, "name": name, "seconds": round(time.perf_counter() - t0, 1), "rc": rc}
    text = (out / f"{name}.log").read_text()
    if rc != 0:
        # Under torchrun a rank's exit code 2 becomes 1: look for our one-line error instead.
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        last = errors[-1:] or [line for line in text.splitlines() if line.strip()][-1:] or ["?"]
        unavailable = any("unknown strategy" in e or "needs DeepSpeed" in e for e in errors)
        row["status"] = "not available" if unavailable else "failed"
        row["message"] = last[0][:200]
        return row
    s = read_run(run_dir)
    row.update(
        status="ok",
        measured_kind=s.measured_kind,
        measured_bytes=s.measured_bytes,
        predicted_bytes=s.predicted_bytes,
        error_pct=s.error_pct,
        predicted_parts=s.predicted_parts,
        tokens_per_s_per_gpu=s.tokens_per_s_per_gpu,
        run_dir=str(run_dir),
    )
    return row


def markdown(rows: list[dict], args, device: str) -> str:
    gib = 1024**3 if not args.smoke else 1024**2
    unit = "GiB" if not args.smoke else "MiB"
    what = "peak reserved" if not args.smoke else "model state"
    lines = [
        f"Predicted vs measured {what} per GPU (worst rank). Card: {device}. "
        f"Date: {datetime.date.today().isoformat()}. micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens, {args.steps} steps, compile={args.compile}, vocab {args.vocab}.",
        "",
        f"Command: `python bench/memory_check.py {' '.join(sys.argv[1:])}`",
        "",
        f"| model | strategy | precision | GPUs | predicted ({unit}) | measured ({unit}) "
        "| error | predicted parts at peak (params/grads/optim/act/transient/slack) | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(
                f"| {r['model']} | {r['strategy']} | {r['precision']} | {r['nproc']} | - | - "
                f"| - | - | {r['status']}: {r.get('message', '')} |"
            )
            continue
        parts = "/".join(
            f"{r['predicted_parts'].get(k, 0) / gib:.2f}"
            for k in ("params", "grads", "optim", "activations", "transient", "overhead")
        )
        err = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}%"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['precision']} | {r['nproc']} | "
            f"{r['predicted_bytes'] / gib:.2f} | {r['measured_bytes'] / gib:.2f} | {err} | "
            f"{parts} | ok |"
        )
    ok = [r for r in rows if r["status"] == "ok" and r["error_pct"] is not None]
    if ok:
        worst = max(ok, key=lambda r: abs(r["error_pct"]))
        within = sum(abs(r["error_pct"]) <= 10 for r in ok)
        lines += [
            "",
            f"{within} of {len(ok)} points within ±10%; the worst is {worst['name']} at "
            f"{worst['error_pct']:+.1f}%.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results directory ($OUT)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few seconds a point")
    ap.add_argument("--models", default=None, help="default 350m,1b (smoke: tiny)")
    ap.add_argument("--strategies", default="single,ddp,fsdp,zero1,zero2,zero3")
    ap.add_argument("--precisions", default=None, help="default bf16,fp32 (smoke: fp32)")
    ap.add_argument("--nprocs", default="1,2", help="GPUs per point")
    ap.add_argument("--all-pairs", action="store_true", help="multi-rank strategies on 1 too")
    ap.add_argument("--micro-batch", type=int, default=None, help="default 4 (smoke: 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 1024 (smoke: 64)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50257, help="synthetic data's vocab")
    ap.add_argument("--compile", action="store_true", help="torch.compile (slower to start)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per point")
    ap.add_argument("extra", nargs="*", help="more overrides for every point")
    args = ap.parse_args(argv)
    if not args.out:
        ap.error("--out (or $OUT) is required")
    args.models = args.models or ("tiny" if args.smoke else "350m,1b")
    args.precisions = args.precisions or ("fp32" if args.smoke else "bf16,fp32")
    args.micro_batch = args.micro_batch or 4
    args.seq_len = args.seq_len or (64 if args.smoke else 1024)
    if args.smoke:
        args.vocab = min(args.vocab, 512)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA device; run with --smoke on CPU", file=sys.stderr)
        return 2
    rows, md = [], ""
    for p in grid(args):
        row = run_point(p, args, out)
        err = row.get("error_pct")
        print(
            f"[memory_check] {row['name']}: {row['status']} in {row['seconds']}s"
            + (f", error {err:+.1f}%" if err is not None else "")
            + (f" ({row['message']})" if "message" in row else ""),
            flush=True,
        )
        rows.append(row)
        # After every point: a check stopped by a time limit still leaves its table.
        md = markdown(rows, args, device)
        (out / "memory_check.md").write_text(md)
        (out / "memory_check.json").write_text(json.dumps(rows, indent=1))
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        from dtrain.cli.compare import read_run, write_chart

        write_chart([read_run(r["run_dir"]) for r in ok], out / "memory_check.png")
    print(md)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
