"""profile.memory_snapshot_steps=N: what the CUDA caching allocator holds, and where it went.

The memory plan predicts peak *reserved* memory; when a run reserves much more than it
allocates (8b under fsdp on 2x H200: 18-19.5 GiB, docs/gpu-tests.md) the gap is memory cached in
segments that no request of the right size and stream could reuse. Each rank records the
allocator's history over the process's first N steps, then writes
<run_dir>/memory/snapshot_rank{r}.pickle (torch.cuda.memory._dump_snapshot: drop it on
https://pytorch.org/memory_viz for the timeline and every allocation's stack) and
segments_rank{r}.json: per CUDA stream, the segments reserved, what is allocated in them and what
sits free (its largest free block). Reserved memory is never given back during a run, so after N
steps the segments are those of the peak so far.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dtrain.errors import ConfigError

log = logging.getLogger("dtrain")

SNAPSHOT_DIR = "memory"
# Allocation events kept (torch keeps the last ones): a 1b step makes a few thousand.
MAX_ENTRIES = 200_000
GiB = 1024**3


def summarize(snapshot: dict) -> dict:
    """Per stream and in all: segments, reserved, allocated, free (inactive) and the largest
    free block, in bytes, from a torch.cuda.memory._snapshot() dict."""

    def empty() -> dict:
        return dict(segments=0, reserved=0, allocated=0, free=0, largest_free=0)

    streams: dict[str, dict] = {}
    total = empty()
    for seg in snapshot["segments"]:
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        for s in (streams.setdefault(str(seg["stream"]), empty()), total):
            s["segments"] += 1
            s["reserved"] += seg["total_size"]
            s["allocated"] += seg["allocated_size"]
            s["free"] += sum(free)
            s["largest_free"] = max([s["largest_free"], *free])
    return {"total": total, "streams": streams}


def describe(summary: dict) -> str:
    """One line: reserved, allocated and free in all, then per stream (stream 0 is the default)."""

    def part(s: dict) -> str:
        return (
            f"{s['reserved'] / GiB:.2f} GiB reserved in {s['segments']} segments, "
            f"{s['allocated'] / GiB:.2f} allocated, {s['free'] / GiB:.2f} free "
            f"(largest free block {s['largest_free'] / GiB:.2f})"
        )

    streams = "; ".join(f"stream {k}: {part(v)}" for k, v in sorted(summary["streams"].items()))
    return f"{part(summary['total'])}; {streams}"


class AllocatorSnapshot:
    """start() before the loop, step() after each optimizer step, stop() after the loop."""

    def __init__(self, steps: int, run_dir: str | Path, env):
        self.steps, self.env = steps, env
        self.dir = Path(run_dir) / SNAPSHOT_DIR
        self.seen = 0
        self.recording = False
        if steps and env.device.type != "cuda":
            raise ConfigError(
                f"profile.memory_snapshot_steps={steps} snapshots the CUDA caching allocator, "
                f"and this run is on {env.device.type}: set it to 0 or train on a GPU"
            )

    def start(self) -> None:
        if self.steps:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
            self.recording = True

    def step(self) -> None:
        self.seen += 1
        if self.recording and self.seen >= self.steps:
            self.write()

    def stop(self) -> None:
        if self.recording:  # the run ended before N steps: what it has
            self.write()

    def write(self) -> dict:
        """Dump the snapshot and its summary, stop recording; returns the summary."""
        self.dir.mkdir(parents=True, exist_ok=True)
        rank = self.env.rank
        torch.cuda.memory._dump_snapshot(str(self.dir / f"snapshot_rank{rank}.pickle"))
        summary = summarize(torch.cuda.memory._snapshot())
        summary["after_steps"] = self.seen
        path = self.dir / f"segments_rank{rank}.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        log.info("memory snapshot after %d steps (rank %d): %s", self.seen, rank, describe(summary))
        return summary
