"""Preemption as schedulers send it, under dtrain-torchrun (2 ranks, gloo, CPU, DataLoader
workers on): a stop signal to the launcher, to every rank's process group (what plain torchrun
and `kill -- -PGID` reach: the rank and its DataLoader workers), or to every process of the job
(Slurm's --signal to a job step, `timeout` on a process group) ends with every rank's
checkpoint saved and exit 0; a launcher killed with -9 leaves no rank training on. One chain
of random-time interruptions per strategy, each resumed from the last, ends on exactly the
weights of an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import latest_complete
from dtrain.checkpoint.weights import load_checkpoint
from tests.conftest import FAST, launch
from tests.faults.helpers import descendants, kill_tree, start, wait_for_step

pytestmark = pytest.mark.slow

MAX_STEPS = 600
RUN = [
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "checkpoint.every_n_steps=40",  # so that some signals land in a periodic save
    "data.num_workers=1",
]
BOUND_S = 60  # signal -> checkpoint on disk -> every process gone, on a loaded 2-core machine
ORPHAN_BOUND_S = 30
# ddp: five of each kind the issue names, two as Slurm sends it, one dead agent (13 stops);
# fsdp, whose save path differs but whose signal path is the same: each kind, 6 stops (CI time).
CHAINS = {
    "ddp": ["agent", "groups"] * 5 + ["all", "all", "kill-agent"],
    "fsdp": ["agent", "groups"] * 2 + ["all", "kill-agent"],
}


def _ranks(launcher: int) -> list[int]:
    return [
        int(p)
        for t in Path(f"/proc/{launcher}/task").glob("*/children")
        for p in t.read_text().split()
    ]


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        alive = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists()
            and "(Z)" not in Path(f"/proc/{p}/stat").read_text().split(")")[1][:4]
        ]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _interrupt(run: Path, how: str, rng: random.Random, strategy: str) -> int:
    """Start (or resume) the run, stop it `how` at a random time; the checkpoint's step."""
    before = latest_complete(run / "checkpoints")
    proc = start(*RUN, f"strategy={strategy}", f"hydra.run.dir={run}", nproc=2)
    try:
        # A random step of this segment, then a random moment within a step or a save: in
        # steps rather than seconds, so that the chain fits MAX_STEPS on any machine's speed.
        first = 1 if before is None else int(before.name.split("_")[1]) + 1
        wait_for_step(run, first + rng.randrange(0, 30), proc, timeout=300)
        time.sleep(rng.uniform(0.0, 0.1))
        ranks = _ranks(proc.pid)
        job = [proc.pid, *descendants(proc.pid)]
        if how == "agent":
            os.kill(proc.pid, signal.SIGTERM)
        elif how == "groups":
            for r in ranks:
                os.killpg(r, signal.SIGTERM)
        elif how == "all":
            for p in job:
                try:
                    os.kill(p, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        else:  # kill-agent: the ranks must notice and stop on their own
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            assert _gone(ranks, ORPHAN_BOUND_S), f"ranks {ranks} still running"
        if how != "kill-agent":
            _, err = proc.communicate(timeout=BOUND_S)
            assert proc.returncode == 0, f"{how}: exit {proc.returncode}\n{err[-4000:]}"
            assert "Traceback" not in err, err[-4000:]
            assert _gone(job, 10), f"{how}: processes of the job left behind"
    finally:
        kill_tree(proc)
    after = latest_complete(run / "checkpoints")
    assert after is not None and after != before, f"{how}: no new checkpoint"
    assert (after / "extra_rank1.pt").exists()
    return int(after.name.split("_")[1])


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_complete(run / "checkpoints")
    assert ckpt is not None and ckpt.name == f"step_{MAX_STEPS:07d}"
    return load_checkpoint(ckpt).model.state_dict()


@pytest.mark.parametrize("strategy", sorted(CHAINS))
def test_random_time_stops_under_torchrun_resume_bit_exact(tmp_path, strategy):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}")
    ref = launch(*FAST, *RUN, f"strategy={strategy}", f"hydra.run.dir={tmp_path / 'ref'}", nproc=2)
    assert ref.returncode == 0, ref.stderr[-3000:]

    run, steps = tmp_path / "run", []
    for how in CHAINS[strategy]:
        steps.append(_interrupt(run, how, rng, strategy))
        assert steps[-1] < MAX_STEPS, f"the run ended before the {how} signal (seed {seed})"
    assert all(a < b for a, b in zip(steps, steps[1:])), steps  # every stop saved anew
    last = launch(*FAST, *RUN, f"strategy={strategy}", f"hydra.run.dir={run}", nproc=2)
    assert last.returncode == 0, last.stderr[-3000:]

    want, got = _weights(tmp_path / "ref"), _weights(run)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs after stops at {steps} (seed {seed})"
