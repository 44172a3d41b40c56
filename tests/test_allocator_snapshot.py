"""profile.memory_snapshot_steps: the summary of where reserved memory sits, the hooks that
write the snapshot once after N steps, and the refusal off CUDA (the GPU run itself:
tests/gpu/test_single_gpu.py)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.reporting import allocator_snapshot as snap
from tests.conftest import train

MiB = 1024**2

SNAPSHOT = {  # the shape of torch.cuda.memory._snapshot(): two streams, three segments
    "segments": [
        {
            "stream": 0,
            "total_size": 20 * MiB,
            "allocated_size": 12 * MiB,
            "blocks": [
                {"size": 12 * MiB, "state": "active_allocated"},
                {"size": 6 * MiB, "state": "inactive"},
                {"size": 2 * MiB, "state": "inactive"},
            ],
        },
        {
            "stream": 0,
            "total_size": 2 * MiB,
            "allocated_size": 2 * MiB,
            "blocks": [{"size": 2 * MiB, "state": "active_allocated"}],
        },
        {
            "stream": 7,
            "total_size": 40 * MiB,
            "allocated_size": 0,
            "blocks": [
                {"size": 30 * MiB, "state": "inactive"},
                {"size": 10 * MiB, "state": "active_awaiting_free"},
            ],
        },
    ],
    "device_traces": [],
}


def test_summary_is_per_stream_and_in_all():
    s = snap.summarize(SNAPSHOT)
    assert s["streams"]["0"] == dict(
        segments=2, reserved=22 * MiB, allocated=14 * MiB, free=8 * MiB, largest_free=6 * MiB
    )
    assert s["streams"]["7"] == dict(
        segments=1, reserved=40 * MiB, allocated=0, free=30 * MiB, largest_free=30 * MiB
    )
    assert s["total"] == dict(
        segments=3, reserved=62 * MiB, allocated=14 * MiB, free=38 * MiB, largest_free=30 * MiB
    )
    line = snap.describe(s)
    assert line.startswith("0.06 GiB reserved in 3 segments") and "stream 7: 0.04 GiB" in line


def test_the_snapshot_is_written_once_after_n_steps(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        _record_memory_history=lambda enabled="all", **kw: calls.append(("record", enabled)),
        _dump_snapshot=lambda path: calls.append(("dump", path)) or open(path, "wb").close(),
        _snapshot=lambda: SNAPSHOT,
    )
    monkeypatch.setattr(torch.cuda, "memory", fake)
    env = types.SimpleNamespace(device=torch.device("cuda", 0), rank=1)
    s = snap.AllocatorSnapshot(3, tmp_path, env)
    s.start()
    for _ in range(5):
        s.step()
    s.stop()
    assert [c[0] for c in calls] == ["record", "dump", "record"]
    assert calls[0][1] == "all" and calls[2][1] is None  # recording on, then off again
    assert calls[1][1].endswith("memory/snapshot_rank1.pickle")
    summary = json.loads((tmp_path / "memory" / "segments_rank1.json").read_text())
    assert summary["after_steps"] == 3 and summary["total"]["reserved"] == 62 * MiB
    off = snap.AllocatorSnapshot(0, tmp_path / "off", env)
    off.start(), off.step(), off.stop()
    assert len(calls) == 3 and not (tmp_path / "off").exists()


def test_off_cuda_it_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="profile.memory_snapshot_steps=2 snapshots the CUDA"):
        train(tmp_path / "run", "profile.memory_snapshot_steps=2")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything is written
    with pytest.raises(ConfigError, match="profile.memory_snapshot_steps must be >= 0"):
        train(tmp_path / "run2", "profile.memory_snapshot_steps=-1")


def test_the_peak_is_summed_by_the_line_that_asked_for_it():
    # Three 5 MiB allocations of one line outweigh one of 12: by_where says so, largest
    # names the 12; what was freed before the peak (line 3) is in neither.
    def ev(action, addr, size, line):
        frames = [{"filename": "/x/model.py", "line": line, "name": "fwd"}]
        return dict(action=action, addr=addr, size=size, stream=0, frames=frames)

    trace = [
        ev("alloc", 1, 9 * MiB, 3),
        ev("free_requested", 1, 9 * MiB, 3),
        ev("alloc", 2, 12 * MiB, 4),
        *(ev("alloc", 10 + k, 5 * MiB, 5) for k in range(3)),
        ev("free_requested", 10, 5 * MiB, 5),
    ]
    # At the end 24 MiB allocated: 2 MiB were before the trace (its net change is 22).
    end = {"stream": 0, "total_size": 32 * MiB, "allocated_size": 24 * MiB, "blocks": []}
    t = snap.timeline({"segments": [end], "device_traces": [trace]}, top=1)
    assert t["peak_allocated"] == 2 * MiB + 27 * MiB
    assert t["at_peak"]["by_where"] == [
        {"bytes": 15 * MiB, "count": 3, "sizes": [(5 * MiB, 3)], "where": "/x/model.py:5 (fwd)"},
        {"bytes": 12 * MiB, "count": 1, "sizes": [(12 * MiB, 1)], "where": "/x/model.py:4 (fwd)"},
    ]
    assert t["at_peak"]["largest"] == [
        {"size": 12 * MiB, "stream": "0", "where": "/x/model.py:4 (fwd)"}
    ]


def test_the_timeline_replays_each_streams_peak_and_names_what_was_live_at_the_peak():
    # Stream 0 ends with 14 MiB allocated of 22 reserved, stream 7 with 0 of 40 (SNAPSHOT's
    # end state). Traced: stream 7 took 30 MiB and gave it back before stream 0 peaked, so
    # what is reserved (62 MiB) is about the sum of the two streams' peaks, never live at once.
    def ev(action, addr, size, stream, line=1):
        torch_frame = snap._TORCH_DIR + "autograd/function.py"
        frames = [{"filename": torch_frame, "line": 9, "name": "f"}]
        frames.append({"filename": "/opt/torch/.venv/x/model.py", "line": line, "name": "fwd"})
        return dict(action=action, addr=addr, size=size, stream=stream, frames=frames)

    trace = [
        ev("segment_map", 100, 40 * MiB, 7),
        ev("alloc", 100, 30 * MiB, 7, line=5),
        ev("free_requested", 100, 30 * MiB, 7),
        ev("free_completed", 100, 30 * MiB, 7),
        ev("segment_alloc", 200, 20 * MiB, 0),
        ev("alloc", 200, 12 * MiB, 0, line=7),
        ev("alloc", 300, 6 * MiB, 0, line=8),
        ev("free_requested", 300, 6 * MiB, 0),
        ev("free_completed", 300, 6 * MiB, 0),
        # Freed under record_stream: free at once for torch's statistics and the segments'
        # allocated_size, completed only after the other stream's work (here: not yet).
        ev("alloc", 400, 4 * MiB, 0, line=9),
        ev("free_requested", 400, 4 * MiB, 0),
    ]
    t = snap.timeline(dict(SNAPSHOT, device_traces=[trace]))
    # Stream 0 held 2 MiB before the trace (its end state 14 minus the trace's net 12).
    assert t["streams"]["0"] == {"peak_allocated": 20 * MiB, "reserved": 22 * MiB}
    assert t["streams"]["7"] == {"peak_allocated": 30 * MiB, "reserved": 40 * MiB}
    assert t["peak_allocated"] == 32 * MiB  # stream 7's 30 and stream 0's 2 then: not 50
    assert t["at_peak"]["allocated"] == {"0": 2 * MiB, "7": 30 * MiB}
    assert t["at_peak"]["largest"] == [
        {"size": 30 * MiB, "stream": "7", "where": "/opt/torch/.venv/x/model.py:5 (fwd)"}
    ]
    line = snap.describe_timeline(t)
    assert "stream 0: peak 0.02 GiB allocated of 0.02 reserved" in line
    assert line.startswith("peak allocated 0.03 GiB in all")
    # No history (recording off): each stream's end state is all there is.
    bare = snap.timeline(SNAPSHOT)
    assert bare["streams"]["0"]["peak_allocated"] == 14 * MiB and bare["at_peak"]["largest"] == []
