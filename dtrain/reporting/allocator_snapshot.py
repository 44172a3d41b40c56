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
from collections import defaultdict
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


# The trace's events that change what is allocated or reserved, with their sign. A block
# counts as free at free_requested, as torch's own allocated statistics and the segments'
# allocated_size count it; its free_completed comes later where record_stream made the
# allocator wait for another stream (FSDP's gradients with strategy.grads_on_compute_stream).
_ALLOCATED = {"alloc": 1, "free_requested": -1}
_RESERVED = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def timeline(snapshot: dict, device: int = 0, top: int = 8) -> dict:
    """Replay the recorded history of `device`: per stream, its peak allocated bytes against
    what it reserves at the end, and the moment the allocated total peaked (per stream, and
    the largest allocations then live, with the Python line that made each). A stream's
    memory serves only that stream's requests, so reserved memory exceeds the peak allocated
    where streams peak at different times (the sum of their peaks) or where one stream's
    free blocks are too small for its next request (its reserved above its own peak).

    The trace holds the last MAX_ENTRIES events since recording began: what was allocated
    before its first event is counted from the end state back (end minus the trace's net
    change), a peak before it is not seen, and only traced allocations are named."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    end = summarize(snapshot)["streams"]
    net_alloc: dict[str, int] = defaultdict(int)
    net_res: dict[str, int] = defaultdict(int)
    for e in trace:
        stream = str(e.get("stream", 0))
        net_alloc[stream] += _ALLOCATED.get(e["action"], 0) * e["size"]
        net_res[stream] += _RESERVED.get(e["action"], 0) * e["size"]
    names = set(end) | set(net_alloc) | set(net_res)

    def at_end(stream: str, key: str) -> int:
        return end.get(stream, {}).get(key, 0)

    alloc = {k: at_end(k, "allocated") - net_alloc[k] for k in names}  # at the trace's start
    peak = dict(alloc)
    best_total, best_at, best_alloc = sum(alloc.values()), -1, dict(alloc)
    for i, e in enumerate(trace):
        sign = _ALLOCATED.get(e["action"])
        if sign is None:
            continue
        stream = str(e.get("stream", 0))
        alloc[stream] += sign * e["size"]
        peak[stream] = max(peak[stream], alloc[stream])
        total = sum(alloc.values())
        if total > best_total:
            best_total, best_at, best_alloc = total, i, dict(alloc)
    # Replayed again to the peak's event: what was live then, and who asked for it.
    live: dict[int, tuple[int, str, str]] = {}  # addr -> (size, stream, where)
    for e in trace[: best_at + 1]:
        sign = _ALLOCATED.get(e["action"])
        if sign is None:
            continue
        if sign > 0:
            live[e["addr"]] = (e["size"], e.get("stream", 0), _where(e.get("frames") or []))
        else:
            live.pop(e["addr"], None)
    largest = sorted(((n, str(s), w) for n, s, w in live.values()), reverse=True)[:top]
    by_where: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # size: count
    for n, _, w in live.values():
        by_where[w][n] += 1
    sites = sorted(by_where.items(), key=lambda kv: -sum(n * c for n, c in kv[1].items()))
    return {
        "streams": {
            k: {"peak_allocated": peak[k], "reserved": at_end(k, "reserved")} for k in names
        },
        "peak_allocated": best_total,
        "at_peak": {
            "allocated": best_alloc,
            "largest": [{"size": n, "stream": s, "where": w} for n, s, w in largest],
            # The traced part of the peak summed by the line that asked for it: many
            # allocations of one line (a block's saved activations) outweigh one large one.
            # With its sizes (the three most frequent): what the allocations were.
            "by_where": [
                {
                    "bytes": sum(n * c for n, c in sizes.items()),
                    "count": sum(sizes.values()),
                    "sizes": sorted(sizes.items(), key=lambda nc: (-nc[1], -nc[0]))[:3],
                    "where": w,
                }
                for w, sizes in sites[: 2 * top]
            ],
        },
    }


_TORCH_DIR = str(Path(torch.__file__).parent) + "/"


def _where(frames: list[dict]) -> str:
    """The first frame outside torch's own package (else the first): who asked for the
    memory."""
    for f in frames:
        if not f.get("filename", "").startswith(_TORCH_DIR):
            return f"{f.get('filename')}:{f.get('line')} ({f.get('name')})"
    f = frames[0] if frames else {}
    return f"{f.get('filename', '?')}:{f.get('line', '?')} ({f.get('name', '?')})"


def describe_timeline(t: dict) -> str:
    """One line: per stream, its peak allocated against its reserved."""
    parts = [
        f"stream {k}: peak {v['peak_allocated'] / GiB:.2f} GiB allocated of "
        f"{v['reserved'] / GiB:.2f} reserved"
        for k, v in sorted(t["streams"].items())
    ]
    return f"peak allocated {t['peak_allocated'] / GiB:.2f} GiB in all; " + "; ".join(parts)


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
            # Python stacks only: symbolising C++ frames makes the dump take minutes.
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
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
        snapshot = torch.cuda.memory._snapshot()
        summary = summarize(snapshot)
        summary["after_steps"] = self.seen
        summary["timeline"] = timeline(snapshot, self.env.device.index or 0)
        path = self.dir / f"segments_rank{rank}.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        log.info("memory snapshot after %d steps (rank %d): %s", self.seen, rank, describe(summary))
        log.info("memory timeline (rank %d): %s", rank, describe_timeline(summary["timeline"]))
        return summary
