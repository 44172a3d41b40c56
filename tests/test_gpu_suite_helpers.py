"""tests/gpu's shared runs, on CPU: trained once for the whole suite, whichever pytest-xdist
worker asks first; a failure is reported to every later asker without running again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env
from tests.gpu.common import once

RACE = """
import sys, time
from pathlib import Path
from tests.gpu.common import once
root = Path(sys.argv[1])
def make(target):
    with open(root / "made", "a") as f:
        f.write("x")
    time.sleep(1)  # long enough for the other process to be waiting on the lock
    target.mkdir()
print(once(root, "straight", make))
"""


def test_a_shared_run_is_made_once_by_racing_workers(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path)], cwd=ROOT, env=cli_env())
        for _ in range(3)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert (tmp_path / "made").read_text() == "x"
    assert (tmp_path / "straight").is_dir()


def test_a_failed_shared_run_fails_every_asker_without_running_again(tmp_path):
    calls = []

    def bad(target):
        calls.append(target)
        raise RuntimeError("NCCL error: boom")

    with pytest.raises(RuntimeError, match="boom"):
        once(tmp_path, "straight", bad)
    with pytest.raises(AssertionError, match="shared run straight failed: RuntimeError: NCCL"):
        once(tmp_path, "straight", bad)
    assert len(calls) == 1
