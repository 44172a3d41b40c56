"""Preemption: a stop signal (trainer.stop_signals; SIGTERM and Slurm's SIGUSR1 by default)
saves a checkpoint within a bounded time and exits 0, and a requeued run resumes from it."""

import os
import signal
import time

import pytest

from dtrain.checkpoint import latest_complete
from tests.conftest import FAST, launch
from tests.faults.helpers import descendants, kill_tree, rank_of, start, wait_for_step

LONG = ["trainer.max_steps=100000", "trainer.eval_every=0", "trainer.log_every=1"]
BOUND_S = 60  # signal -> checkpoint on disk -> exit; generous for a loaded CI machine


def _preempt(run, sig, *extra, nproc=1, target_rank=None):
    proc = start(*LONG, *extra, f"hydra.run.dir={run}", nproc=nproc)
    try:
        wait_for_step(run, 2, proc)
        t0 = time.time()
        pids = [proc.pid]
        if target_rank is not None:
            pids = [p for p in descendants(proc.pid) if rank_of(p) == target_rank]
            pids = [p for p in pids if "launch/train.py" in open(f"/proc/{p}/cmdline").read()]
        for pid in pids:
            os.kill(pid, sig)
        _, err = proc.communicate(timeout=BOUND_S)
        elapsed = time.time() - t0
    finally:
        kill_tree(proc)
    return proc.returncode, err, elapsed


@pytest.mark.parametrize(
    "sig,extra",
    [
        (signal.SIGTERM, []),
        (signal.SIGUSR1, []),
        (signal.SIGUSR2, ["trainer.stop_signals=[SIGUSR2]"]),
    ],
    ids=["SIGTERM", "SIGUSR1", "configured-SIGUSR2"],
)
def test_signal_saves_and_exits_0_then_requeue_resumes(tmp_path, sig, extra):
    run = tmp_path / "run"
    rc, err, elapsed = _preempt(run, sig, *extra)
    assert rc == 0, err[-3000:]
    assert f"received {signal.Signals(sig).name}: saving a checkpoint" in err
    assert elapsed < BOUND_S
    ckpt = latest_complete(run / "checkpoints")
    assert ckpt is not None
    step = int(ckpt.name.split("_")[1])
    again = launch(*FAST, *LONG[1:], f"trainer.max_steps={step + 2}", f"hydra.run.dir={run}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} (step {step})" in again.stderr


def test_a_signal_not_listed_is_not_caught(tmp_path):
    # trainer.stop_signals=[SIGTERM]: SIGUSR1 keeps its default action (terminate, no save).
    rc, _, _ = _preempt(tmp_path / "run", signal.SIGUSR1, "trainer.stop_signals=[SIGTERM]")
    assert rc == -signal.SIGUSR1
    assert latest_complete(tmp_path / "run" / "checkpoints") is None


@pytest.mark.slow
def test_ddp_signal_to_one_rank_stops_both_at_the_same_step(tmp_path):
    run = tmp_path / "run"
    rc, err, _ = _preempt(run, signal.SIGUSR1, "strategy=ddp", nproc=2, target_rank=1)
    assert rc == 0, err[-3000:]
    ckpt = latest_complete(run / "checkpoints")
    assert ckpt is not None and (ckpt / "extra_rank1.pt").exists()
