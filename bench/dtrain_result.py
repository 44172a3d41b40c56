"""Steady-state numbers of a dtrain run, read from its metrics.jsonl, as one JSON object.

The first logged interval holds torch.compile and warm-up; the median of the later intervals is
the run's tokens/s (what the plain loop's timed window measures too).

    python bench/dtrain_result.py RUN_DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarize(run_dir: Path) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in recs if "tokens_per_s" in r]
    steady = train[1:] or train
    cfg_path = run_dir / ".hydra" / "config.yaml"
    mem = train[-1]["memory_per_rank"]
    gib = 2**30
    return {
        "loop": "dtrain",
        "run_dir": str(run_dir),
        "config": cfg_path.read_text() if cfg_path.exists() else None,
        "world_size": len(mem),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_gpu"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if steady[0]["mfu"] else None,
        "intervals": [round(r["tokens_per_s"]) for r in train],
        # Start-up: the loop's seconds to the end of the first logged interval (compiles
        # included) and that interval's peak reserved (a first step run differently shows here).
        "first_interval": {
            "step": train[0]["step"],
            "elapsed_s": train[0].get("elapsed_s"),
            "peak_reserved_gib": max(
                m.get("peak_reserved_bytes", 0) for m in train[0]["memory_per_rank"]
            )
            / gib,
        },
        "memory_per_rank": [
            {
                "peak_allocated_gib": m.get("peak_allocated_bytes", 0) / gib,
                "peak_reserved_gib": m.get("peak_reserved_bytes", 0) / gib,
                "params_gib": m["params_bytes"] / gib,
                "grads_gib": m["grads_bytes"] / gib,
                "optim_gib": m["optim_bytes"] / gib,
            }
            for m in mem
        ],
        "final_loss": train[-1]["loss"],
        "memory_predicted_gib": next(
            (r["memory_predicted"]["total_bytes"] / gib for r in recs if "memory_predicted" in r),
            None,
        ),
        "memory_prediction_error_pct": train[-1].get("memory_prediction_error_pct"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = summarize(args.run_dir)
    res.pop("config")
    print(json.dumps(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
