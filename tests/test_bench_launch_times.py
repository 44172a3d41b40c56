"""bench/launch_times.py's clock: the time to a step, and the limit that stops a slow start."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

from tests.conftest import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("launch_times", ROOT / "bench/launch_times.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_step_time_is_when_the_step_is_written(tmp_path):
    lt, metrics = _module(), tmp_path / "metrics.jsonl"
    code = f"import time; time.sleep(1); open({str(metrics)!r}, 'w').write('{{\"step\": 10, }}\\n')"
    t0 = time.perf_counter()
    proc = _spawn(code + "; time.sleep(30)")
    try:
        t = lt.step_time(metrics, 10, proc, t0, limit=20)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert t is not None and 0.9 < t < 10


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_start_past_the_limit_is_stopped_with_its_children(tmp_path):
    lt = _module()
    child = tmp_path / "child.pid"
    # A launcher that starts a worker in a session of its own (as torchrun starts each rank,
    # so the launcher's group does not hold it) and never logs a step.
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); "
        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    t0 = time.perf_counter()
    proc = _spawn(code)
    assert lt.step_time(tmp_path / "metrics.jsonl", 10, proc, t0, limit=2) is None
    assert time.perf_counter() - t0 < 15
    assert proc.returncode is not None and proc.returncode < 0
    pid = int(child.read_text())
    for _ in range(50):  # the worker is gone too
        if not _alive(pid):
            break
        time.sleep(0.1)
    else:
        os.killpg(pid, 9)
        raise AssertionError(f"worker {pid} outlived the limit")


def test_a_strategy_is_skipped_when_gpus_or_the_budget_run_out():
    lt, now = _module(), time.perf_counter()
    assert lt.skip_reason(2, 1, 90, None) == "skipped: needs 2 GPUs"
    assert lt.skip_reason(2, 2, 90, None) is None
    assert lt.skip_reason(1, 2, 90, now + 500) is None
    assert "budget" in lt.skip_reason(1, 2, 90, now + 150)
