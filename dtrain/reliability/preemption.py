"""Stopping on request: a stop signal, or the death of the launcher, ends the run with a save.

- StopSignal: SIGTERM/SIGINT/SIGUSR1 (trainer.stop_signals) -> finish this step, save, exit 0.
  Ranks must agree on the step at which they stop, so the local flags are max-reduced every
  step. The reduction of step s is read at the end of step s+1, through a pinned buffer and an
  event: waiting for it never stalls the GPU, whose queue already holds step s+1.
- OrphanWatch: under torchrun, a rank whose agent died (kill -9, OOM killer) would otherwise
  train on unsupervised; it notices within POLL_S, requests the same stop, and exits hard if
  the save has not let it go ORPHAN_EXIT_S later.
- ignore_stop_signals: what DataLoader workers run first. torchrun, Slurm and `kill -- -PGID`
  signal whole process groups; a worker that died of SIGTERM made the rank fail in the middle
  of its step or save. The rank owns its workers and ends them itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch

log = logging.getLogger("dtrain")

# Every signal a scheduler or a terminal uses to ask a job to stop.
WORKER_IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def ignore_stop_signals(_worker_id: int | None = None) -> None:
    """DataLoader worker_init_fn: leave stopping to the rank (see the module docstring)."""
    for s in WORKER_IGNORED:
        signal.signal(s, signal.SIG_IGN)


# What "save a checkpoint and exit 0" means by default (trainer.stop_signals).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class StopSignal:
    def __init__(self, signals=STOP_SIGNALS):
        self.local = False
        self.reason: str | None = None
        self.device, self.distributed = torch.device("cpu"), False
        self._pending = None
        self._old = {}
        for s in (signal.Signals[name] for name in signals):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test harness)
                pass

    def attach(self, device: torch.device, distributed: bool) -> None:
        """Where the ranks vote, once the process group exists (signals are caught before)."""
        self.device, self.distributed = device, distributed

    def _handle(self, signum, frame) -> None:
        self.request(f"received {signal.Signals(signum).name}")

    def request(self, why: str) -> None:
        """Stop after this step, saving first (safe from a signal handler or another thread)."""
        if not self.local:
            self.reason = why
            log.warning("%s: saving a checkpoint and stopping", why)
        self.local = True

    def poll(self) -> bool:
        if not self.distributed:
            return self.local
        import torch.distributed as dist

        agreed = False
        if self._pending is not None:
            host, event = self._pending
            if event is not None:
                event.synchronize()
            agreed = bool(host.item())
        # A fill kernel, not torch.tensor(..., device=cuda): that copies from pageable memory,
        # which waits for the whole stream. It made every multi-rank step wait for the end of
        # the one before, so each forward started with nothing queued (the 8b fp8 fsdp trace
        # of 2026-11-28: 64 ms in cudaStreamSynchronize at each step's start).
        flag = torch.full((1,), int(self.local), dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if self.device.type == "cuda":
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event)
        else:
            self._pending = (flag, None)
        return agreed

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


class OrphanWatch:
    """Under torchrun: stop (with a save) when the agent that started this rank is gone."""

    POLL_S = 1.0
    ORPHAN_EXIT_S = 120.0  # a save of an 8B model's shards fits; a wedged rank does not linger

    def __init__(self, stop: StopSignal, poll_s: float = POLL_S, exit_s: float = ORPHAN_EXIT_S):
        self.stop, self.poll_s, self.exit_s = stop, poll_s, exit_s
        self.parent = os.getppid()
        self._done = threading.Event()
        self.thread = None
        if "TORCHELASTIC_RUN_ID" in os.environ and self.parent > 1:
            self.thread = threading.Thread(target=self._loop, name="dtrain-orphan", daemon=True)
            self.thread.start()

    def _loop(self) -> None:
        while not self._done.wait(self.poll_s):
            if os.getppid() != self.parent:
                self.stop.request(f"the torchrun agent (pid {self.parent}) died")
                if not self._done.wait(self.exit_s):
                    log.error(
                        "still running %.0f s after the agent died: exiting (code 3)", self.exit_s
                    )
                    logging.shutdown()
                    os._exit(3)
                return

    def close(self) -> None:
        self._done.set()
