"""How long the training loop was blocked by each checkpoint, sync against async, from two
runs' metrics.jsonl (the `checkpoint` records: stall_s, save_s, async), as one JSON object.

    python bench/ckpt_stall.py SYNC_RUN_DIR ASYNC_RUN_DIR [--out FILE]

stall_s: the loop's time blocked by one save (taking the state, checking it finite, writing it or
copying it to host memory, waiting for it, committing it), snapshot_s the first two of those,
dcp_s DCP's call on the loop's thread (sync: its plan and write; async: its staging to host
memory, DCP planning in its background thread), at_save_s (async) the loop's time blocked at
the save itself; save_s: from the start of the save to
its COMPLETE marker. The first save of a run also pays one-time costs (the async save's process
group and thread, host buffers), so the medians are the figures to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def stalls(run_dir: Path) -> dict:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines if line.strip()]
    recs = [(r["step"], r["checkpoint"]) for r in recs if "checkpoint" in r]
    return {
        "run_dir": str(run_dir),
        "steps": [step for step, _ in recs],
        "async": [c["async"] for _, c in recs],
        "stall_s": [round(c["stall_s"], 4) for _, c in recs],
        "save_s": [round(c["save_s"], 4) for _, c in recs],
        # The part of stall_s spent taking the state and checking it (the rest is DCP's).
        "snapshot_s": [round(c["snapshot_s"], 4) for _, c in recs if "snapshot_s" in c],
        # DCP's call on the loop's thread: the plan and write (sync), the staging (async).
        "dcp_s": [round(c["dcp_s"], 4) for _, c in recs if "dcp_s" in c],
        # Async: the loop's time blocked at the save itself (the rest of stall_s is waiting
        # for the write later: where the next save comes before it is done, or the run ends).
        "at_save_s": [round(c["at_save_s"], 4) for _, c in recs if "at_save_s" in c],
        # Async on a GPU, first save: the part of at_save_s spent making the pinned buffers.
        "buffers_s": [round(c["buffers_s"], 4) for _, c in recs if "buffers_s" in c],
        "median_stall_s": statistics.median(c["stall_s"] for _, c in recs) if recs else None,
        "median_save_s": statistics.median(c["save_s"] for _, c in recs) if recs else None,
    }


def compare(sync_dir: Path, async_dir: Path) -> dict:
    sync, background = stalls(sync_dir), stalls(async_dir)
    a, b = sync["median_stall_s"], background["median_stall_s"]
    return {"sync": sync, "async": background, "stall_ratio": a / b if a and b else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sync_run_dir", type=Path)
    ap.add_argument("async_run_dir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = compare(args.sync_run_dir, args.async_run_dir)
    print(json.dumps(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
