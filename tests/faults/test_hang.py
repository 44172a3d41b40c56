"""Hangs: a rank stopped with SIGSTOP (DTRAIN_FAULT=train.step=stop@1) is named, with its host,
within trainer.collective_timeout_s instead of the job blocking forever."""

import re
import time

from tests.faults.helpers import kill_tree, start

TIMEOUT_S = 5


def test_stopped_rank_is_named_within_the_timeout(tmp_path):
    proc = start(
        "strategy=ddp",
        "trainer.max_steps=50",
        "trainer.eval_every=0",
        "trainer.log_every=1",
        f"trainer.collective_timeout_s={TIMEOUT_S}",
        f"hydra.run.dir={tmp_path}/run",
        nproc=2,
        env_extra={"DTRAIN_FAULT": "train.step=stop@1#3"},
    )
    lines, t_step2, t_error = [], None, None
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "step 2 |" in line:
                t_step2 = time.time()
            if line.startswith("error: "):
                t_error = time.time()
                break
    finally:
        kill_tree(proc)  # rank 1 is still stopped: end it (and torchrun) by pid
    text = "".join(lines)
    assert t_error is not None, text[-3000:]
    error = [ln for ln in lines if ln.startswith("error: ")][0]
    assert re.search(r"rank 1 \(host \S+, pid \d+\) silent for \d+ s since step [12]", error), error
    assert "trainer.collective_timeout_s" in error and "Traceback" not in text
    # Reported within the timeout (plus a heartbeat interval and slack for a busy machine).
    assert t_error - t_step2 < TIMEOUT_S + 20, t_error - t_step2
