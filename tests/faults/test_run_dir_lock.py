"""One run per run dir (dtrain/reliability/rundir.py): a second run in a run dir that a live run
holds exits 2 naming the holder and touches nothing; the lock of a dead run is stale and taken
over; every rank of one torchrun job shares the lock that rank 0 holds."""

from __future__ import annotations

import json
import os
import signal

import pytest

from dtrain.errors import ConfigError
from dtrain.reliability import rundir
from tests.conftest import launch
from tests.faults.helpers import kill_tree, one_error_line, snapshot, start, wait_for_step

LONG = ["trainer.max_steps=100000", "trainer.eval_every=0", "trainer.log_every=1"]


def test_a_second_run_in_a_held_run_dir_exits_2_and_touches_nothing(tmp_path):
    run = tmp_path / "run"
    first = start(*LONG, "checkpoint.every_n_steps=2", f"hydra.run.dir={run}")
    try:
        wait_for_step(run, 3, first)
        first.send_signal(signal.SIGSTOP)  # frozen: the snapshot below must stay valid
        before = snapshot(run)
        second = launch("trainer.max_steps=4", f"hydra.run.dir={run}")
        assert second.returncode == 2, second.stderr[-3000:]
        line = one_error_line(second.stderr)
        assert f"run dir {run} is in use by another run (pid {first.pid} " in line, line
        assert "choose another hydra.run.dir" in line
        assert snapshot(run) == before
        # Under torchrun too: the launcher passes exit 2 through, with the ranks' one line.
        third = launch("strategy=ddp", "trainer.max_steps=4", f"hydra.run.dir={run}", nproc=2)
        assert third.returncode == 2, third.stderr[-3000:]
        assert f"is in use by another run (pid {first.pid} " in one_error_line(third.stderr)
        assert snapshot(run) == before
    finally:
        first.send_signal(signal.SIGCONT)
        kill_tree(first)


def test_the_lock_of_a_killed_run_is_stale_and_taken_over(tmp_path):
    run = tmp_path / "run"
    first = start(*LONG, f"hydra.run.dir={run}")  # its DataLoader worker shares no lock
    wait_for_step(run, 2, first)
    holder = json.loads((run / rundir.LOCK).read_text())
    assert holder["pid"] == first.pid
    kill_tree(first)  # SIGKILL: no clean-up ran
    again = launch("trainer.max_steps=2", "trainer.eval_every=0", f"hydra.run.dir={run}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run / rundir.LOCK).read_text())["pid"] != first.pid


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    run = tmp_path / "run"
    assert rundir.acquire(run)
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker: alive while its parent lets go of the run dir
        os.close(w)
        os.write(ready_w, b"x")  # running: the at-fork hook is done
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.read(ready_r, 1)
    try:
        rundir.release(run)
        assert rundir.acquire(run)  # a fresh open file: the child holds no copy of the lock
        rundir.release(run)
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
    assert (run / rundir.LOCK).read_text() == ""  # a run that ended names no holder


def test_one_run_dir_however_it_is_spelled(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert rundir.acquire("../run")  # launch/train.py's spelling of hydra.run.dir
    try:
        with rundir.hold_run_dir(str(tmp_path / "run")):  # Hydra's, `..` folded: the same lock
            pass
        assert rundir._key(tmp_path / "run") in rundir._held
    finally:
        rundir.release("../run")


def test_ranks_of_one_job_share_the_lock_and_other_jobs_are_refused(tmp_path, monkeypatch):
    run = tmp_path / "run"
    job = {"TORCHELASTIC_RUN_ID": "a", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for k, v in job.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RANK", "0")
    assert rundir.acquire(run)
    fd = rundir._held.pop(rundir._key(run))  # rank 0 holds it; below, as in rank 1's process
    try:
        monkeypatch.setenv("RANK", "1")
        # rank 1 of the same job on a replacement node, whose agent counts restarts from 0
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        assert rundir.acquire(run) is False  # no wait, no lock
        monkeypatch.setenv("MASTER_PORT", "2")  # a rank of another job
        monkeypatch.setattr(rundir, "WAIT_S", 0.5)
        with pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+ on "):
            rundir.acquire(run)
    finally:
        os.close(fd)
