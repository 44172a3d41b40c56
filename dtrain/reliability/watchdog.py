"""Hangs: name the rank that stopped answering instead of blocking forever.

Every rank's collectives time out after trainer.collective_timeout_s (passed to
init_process_group). A timed-out collective only says "timed out waiting for recv"; to name
the culprit each rank publishes a heartbeat (its step, host, pid and the time) to the
rendezvous store from a daemon thread. The store is torchrun's, so it outlives any worker.
When a collective times out, the survivors read the heartbeats: a rank whose heartbeat went
silent is stopped or dead; a rank whose heartbeat is fresh but whose step is behind is stuck
in its own code.

On GPUs the NCCL watchdog kills the process when a collective times out; the heartbeat
thread then logs the same diagnosis first, once the local step has not moved for the timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import torch.distributed as dist

from dtrain.errors import FaultError

log = logging.getLogger("dtrain")

KEY = "dtrain/heartbeat/{rank}"


def is_timeout(e: BaseException) -> bool:
    """Does `e` look like a collective that timed out (gloo, NCCL, the store)?"""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


class Heartbeat:
    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        # Stale after a few missed beats, and always well inside the collective timeout.
        self.interval = max(0.2, min(10.0, timeout_s / 5))
        self.host = socket.gethostname()
        self.step = 0
        self._step_since = time.time()
        self._reported = False
        self._stop = threading.Event()
        # A new step wakes the beat early (at most every interval/10): a rank that stops right
        # after fast steps must still have told which step it reached.
        self._wake = threading.Event()
        self._last_beat = 0.0
        self.store = dist.distributed_c10d._get_default_store()
        self._beat()
        self.thread = threading.Thread(target=self._loop, name="dtrain-heartbeat", daemon=True)
        self.thread.start()

    def set_step(self, step: int) -> None:
        if step != self.step:
            self.step, self._step_since = step, time.time()
            if self._step_since - self._last_beat > self.interval / 10:
                self._wake.set()

    def _beat(self) -> None:
        self._last_beat = time.time()
        value = {"step": self.step, "host": self.host, "pid": os.getpid(), "time": time.time()}
        self.store.set(KEY.format(rank=self.rank), json.dumps(value))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
                stalled = time.time() - self._step_since
                # Step 0 is start-up (compiling, loading): only the loop is watched.
                if (
                    self.step > 0
                    and stalled > self.timeout_s + self.interval
                    and not self._reported
                ):
                    self._reported = True  # NCCL may abort the process: say why first
                    log.error("no progress for %.0f s: %s", stalled, self.diagnose())
            except Exception:  # the store went away (shutdown): nothing left to report
                return

    def peers(self) -> dict[int, dict | None]:
        """Each rank's last heartbeat (None if it never sent one)."""
        out = {}
        for r in range(self.world_size):
            key = KEY.format(rank=r)
            try:
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:
                out[r] = None
        return out

    def diagnose(self) -> str:
        now, stale = time.time(), []
        peers = self.peers()
        for r, hb in sorted(peers.items()):
            if r == self.rank:
                continue
            if hb is None:
                stale.append(f"rank {r} never reported")
            elif now - hb["time"] > 2.5 * self.interval:
                stale.append(
                    f"rank {r} (host {hb['host']}, pid {hb['pid']}) silent for "
                    f"{now - hb['time']:.0f} s since step {hb['step']}: stopped or dead"
                )
        if not stale:  # everyone alive: whoever is behind is stuck in its own code
            for r, hb in sorted(peers.items()):
                if hb is not None and r != self.rank and hb["step"] < self.step:
                    stale.append(
                        f"rank {r} (host {hb['host']}, pid {hb['pid']}) is alive but stuck "
                        f"at step {hb['step']}"
                    )
        who = "; ".join(stale) if stale else "no rank looks stopped (a network problem?)"
        return (
            f"rank {self.rank} (host {self.host}) waited {self.timeout_s:g} s "
            f"(trainer.collective_timeout_s) in a collective at step {self.step}: {who}"
        )

    def timeout_error(self, e: BaseException) -> FaultError:
        err = FaultError(self.diagnose())
        err.every_rank = True  # rank 0 may be the one that hung: every survivor speaks
        return err

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        # Joined, not left to die with the interpreter: a daemon thread still inside a store
        # call at exit is ended by pthread_exit from C++ code, which aborts the whole process
        # ("terminate called without an active exception", seen on 2-rank CPU runs).
        self.thread.join(timeout=2 * self.interval)
