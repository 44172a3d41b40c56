"""Does a resumed run continue where an uninterrupted one goes? Per-step training losses of two
run dirs compared over the steps both logged after `--after` (the resumed run's checkpoint).

    python bench/resume_check.py STRAIGHT_RUN RESUMED_RUN --after 10 [--out FILE]

On CPU dtrain's resume is bit-exact (tests/test_checkpoint.py); on a GPU kernels may differ in
the last bits from step to step (atomics in backward kernels), so this reports the largest
relative difference instead of asserting equality.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    # A resumed run appends to the same metrics.jsonl: the last record of a step wins.
    return {r["step"]: r["loss"] for r in recs if "tokens_per_s" in r}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("straight", type=Path)
    ap.add_argument("resumed", type=Path)
    ap.add_argument("--after", type=int, required=True, help="the step the resumed run saved at")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    a, b = losses(args.straight), losses(args.resumed)
    steps = sorted(s for s in a.keys() & b.keys() if s > args.after)
    diffs = {s: abs(a[s] - b[s]) / abs(a[s]) for s in steps}
    res = {
        "steps_compared": steps,
        "straight": [a[s] for s in steps],
        "resumed": [b[s] for s in steps],
        "max_rel_diff": max(diffs.values()) if diffs else None,
    }
    print(json.dumps(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
