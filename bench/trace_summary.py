"""Where a step's GPU time goes, from the torch.profiler traces a run recorded
(profile.enabled=true: <run_dir>/tensorboard/profile/rank0.*.pt.trace.json).

    python bench/trace_summary.py RUN_DIR [RUN_DIR ...] [--steps 2] [--top 8] [--waits]
        [--rank 0]

Prints, per run, the GPU kernel time of one rank per step by kind (matmuls, attention, NCCL,
Inductor's fused kernels, the optimizer, other eager kernels) and the busiest kernels, as
markdown. NCCL kernels run on their own streams, so the kinds add up to more than the step
when communication overlaps compute; `compute stream` is the busiest stream's time.

--waits adds what the compute stream waited for. Its idle gaps of WAIT_MIN_US or more are
summed by cause: the kernel on another stream that ended just before the gap did (an
all-gather the next kernel needed, say), or "the host" where nothing did (the next kernel was
launched late). It also lists the host's blocking syncs of SYNC_MIN_US or more, with the
operator they ran under (an .item(), a copy from pageable memory), and the launch lag of the
compute stream's kernels (kernel start minus its launch) in ten slices of the traced window:
near 0, the GPU runs at the pace of the host's launches.

--host adds where the host's time goes, on the threads that launch work (the main thread runs
the forward and the optimizer, autograd's thread the backward): each thread's busy time (the
union of its outermost events) and its busiest event names by inclusive time (FSDP's hooks,
`Torch-Compiled Region`s, operators), per step, with how many of each a step ran.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
from pathlib import Path

KINDS = (  # first match wins
    ("nccl", ("nccl",)),
    ("attention", ("sdpa", "flash", "fmha")),
    # dtrain's Triton int8 GEMMs by their kernels' names (else an int8 trace counts them as
    # "other eager"); not "int8_mm" alone: Inductor names the quantizes it fuses
    # before them triton_red_fused_..._int8_mm_..., and those are its own kernels.
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "_int8_mm_kernel", "_int8_mm_tma_kernel")),
    ("optimizer", ("adam",)),
    ("inductor (fused)", ("triton",)),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other eager")


WAIT_MIN_US = 300  # a compute-stream gap counted as a wait
SYNC_MIN_US = 1000  # a host sync listed
CAUSE_SLACK_US = 60  # how far before a gap's end the kernel that ended it may have ended
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def load(run_dir: Path, rank: int = 0) -> list[dict]:
    pattern = f"rank{rank}.*.pt.trace.json"
    trace = next(Path(run_dir, "tensorboard", "profile").glob(pattern))
    return json.loads(trace.read_text())["traceEvents"]


def waits(events: list[dict], steps: int) -> dict:
    """What the compute stream waited for, the host's syncs and the launch lag (see above)."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    streams = collections.defaultdict(list)
    for e in kernels:
        streams[e.get("tid")].append(e)
    compute = max(streams, key=lambda t: sum(e["dur"] for e in streams[t]))
    own, others = streams[compute], [e for t, k in streams.items() if t != compute for e in k]
    ends = sorted((e["ts"] + e["dur"], e["name"]) for e in others)
    causes, counts = collections.Counter(), collections.Counter()
    for a, b in zip(own, own[1:]):
        start, end = a["ts"] + a["dur"], b["ts"]
        if end - start < WAIT_MIN_US:
            continue
        i = bisect.bisect_right(ends, (end + 5, "\uffff")) - 1  # the last to end by the gap's end
        near = i >= 0 and ends[i][0] >= end - CAUSE_SLACK_US
        cause = kind(ends[i][1]) + ": " + ends[i][1][:60] if near else "the host (launched late)"
        causes[cause] += end - start
        counts[cause] += 1
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    syncs = []
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("name") in SYNCS and e["dur"] >= SYNC_MIN_US:
            under = [
                o
                for o in ops
                if o.get("tid") == e.get("tid")
                and o["ts"] <= e["ts"]
                and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
            ]
            outer = min(under, key=lambda o: o["ts"])["name"] if under else "-"
            syncs.append((e["ts"], e["dur"] / 1e3, e["name"], outer))
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    lags = [
        (k["ts"], k["ts"] - launches[c])
        for k in own
        if (c := k.get("args", {}).get("correlation")) in launches
    ]
    t0, t1 = own[0]["ts"], own[-1]["ts"] + own[-1]["dur"]
    slices = []
    for i in range(10):
        lo, hi = t0 + (t1 - t0) * i / 10, t0 + (t1 - t0) * (i + 1) / 10
        part = [lag for ts, lag in lags if lo <= ts < hi]
        slices.append(statistics.median(part) / 1e3 if part else None)
    ms = 1e-3 / steps
    return {
        "window_ms": (t1 - t0) * 1e-3,
        "gaps_ms": {c: v * ms for c, v in causes.most_common()},
        "gap_counts": dict(counts),
        "syncs": [
            (round((ts - t0) / 1e3, 1), dur, name, op) for ts, dur, name, op in sorted(syncs)
        ],
        "lag_ms_by_tenth": slices,
    }


HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def host(events: list[dict], steps: int, threads: int = 2) -> list[dict]:
    """Per thread (the `threads` busiest by outermost-event time): busy ms per step, and the
    event names by inclusive ms per step with their count per step."""
    by_tid = collections.defaultdict(list)
    for e in events:
        # ProfilerStep#N spans the whole step, idle time included: it is not work
        if (
            e.get("ph") == "X"
            and e.get("cat") in HOST_CATS
            and not str(e.get("name", "")).startswith("ProfilerStep#")
        ):
            by_tid[e.get("tid")].append(e)
    out = []
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        busy, end = 0.0, float("-inf")
        # the union of the intervals (nested events add nothing) of operators and annotations:
        # Python frames (profile.with_stack) span whole steps, waits included
        for e in (e for e in evs if e.get("cat") != "python_function"):
            s, f = e["ts"], e["ts"] + e["dur"]
            if s >= end:
                busy += f - s
                end = f
            elif f > end:
                busy += f - end
                end = f
        names, counts = collections.Counter(), collections.Counter()
        for e in evs:
            names[e["name"]] += e["dur"]
            counts[e["name"]] += 1
        out.append(
            {
                "tid": tid,
                "busy_ms": busy / 1e3 / steps,
                "names": [(n, v / 1e3 / steps, counts[n] / steps) for n, v in names.most_common()],
            }
        )
    return sorted(out, key=lambda t: -t["busy_ms"])[:threads]


def host_markdown(threads: list[dict], top: int) -> str:
    lines = []
    for t in threads:
        lines += [
            f"Host thread {t['tid']}: busy {t['busy_ms']:.1f} ms per step",
            "",
            "| event | ms per step (inclusive) | per step |",
            "|---|---|---|",
        ]
        lines += [f"| `{n[:80]}` | {v:.1f} | {c:g} |" for n, v, c in t["names"][:top]]
        lines.append("")
    return "\n".join(lines)


def waits_markdown(w: dict, steps: int) -> str:
    total = sum(w["gaps_ms"].values())
    lines = [
        f"Compute stream idle (gaps of {WAIT_MIN_US} us or more): {total:.1f} ms per step, by "
        f"what ended just before each gap ended ({steps} steps traced, "
        f"{w['window_ms']:.0f} ms window)",
        "",
        "| waited for | ms per step | gaps |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {v:.1f} | {w['gap_counts'][c]} |" for c, v in w["gaps_ms"].items()]
    lines += [
        "",
        f"Host syncs of {SYNC_MIN_US / 1e3:.0f} ms or more (ms from the window's start):",
        "",
        "| at ms | ms | call | under |",
        "|---|---|---|---|",
    ]
    lines += [f"| {t} | {d:.1f} | {n} | {o} |" for t, d, n, o in w["syncs"]] or ["| - | | | |"]
    lag = " / ".join("-" if v is None else f"{v:.1f}" for v in w["lag_ms_by_tenth"])
    lines += [
        "",
        f"Launch lag of the compute stream's kernels, median ms per tenth of the window: {lag}",
    ]
    return "\n".join(lines) + "\n"


def summarize(run_dir: Path, steps: int, rank: int = 0) -> dict:
    events = [e for e in load(run_dir, rank) if e.get("cat") == "kernel"]
    by_kind, by_name, by_stream = (collections.Counter() for _ in range(3))
    for e in events:
        by_kind[kind(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        by_stream[e.get("tid")] += e["dur"]
    ms = 1e-3 / steps
    return {
        "run": Path(run_dir).name,
        "compute_stream_ms": max(by_stream.values()) * ms,
        "kinds_ms": {k: v * ms for k, v in by_kind.most_common()},
        "top_ms": [(n, v * ms) for n, v in by_name.most_common()],
    }


def markdown(s: dict, top: int) -> str:
    lines = [f"**{s['run']}**: compute stream {s['compute_stream_ms']:.0f} ms per step", ""]
    lines += ["| kind | ms per step |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in s["kinds_ms"].items()]
    lines += ["", "| kernel | ms per step |", "|---|---|"]
    lines += [f"| `{n[:90]}` | {v:.1f} |" for n, v in s["top_ms"][:top]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=2, help="steps in the trace (profile.active)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per run")
    ap.add_argument("--rank", type=int, default=0, help="whose trace")
    ap.add_argument("--waits", action="store_true", help="what the compute stream waited for")
    ap.add_argument("--host", action="store_true", help="where the host's time goes")
    args = ap.parse_args()
    for d in args.run_dirs:
        print(markdown(summarize(d, args.steps, args.rank), args.top))
        if args.waits:
            print(waits_markdown(waits(load(d, args.rank), args.steps), args.steps))
        if args.host:
            print(host_markdown(host(load(d, args.rank), args.steps), args.top))


if __name__ == "__main__":
    main()
