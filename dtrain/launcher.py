"""dtrain-torchrun: torchrun that stops the way schedulers ask it to.

    dtrain-torchrun --standalone --nproc-per-node=8 launch/train.py strategy=fsdp
    python -m dtrain.launcher ...            (the same; any torchrun option works)

Plain torchrun meets a stop signal by raising in its agent, sending the signal to every
worker's whole process group (DataLoader workers included), SIGKILLing what is left after
--shutdown-timeout (30 s) and exiting 1; SIGUSR1, Slurm's warning signal, is not handled at
all and kills the agent, leaving its ranks to train on. This launcher differs in three ways:

- SIGTERM, SIGINT or SIGUSR1 (to the agent, its process group, or with the whole job step as
  Slurm sends it) is passed to each rank's main process only; the ranks agree on a step,
  save a checkpoint and exit 0, and so does the launcher. No worker is restarted meanwhile.
  A second stop signal, SIGHUP, SIGQUIT, or ranks still running DTRAIN_STOP_GRACE_S
  (default 600) after the first signal fall back to torchrun's own shutdown.
- Workers that all failed with the same dtrain exit code (2: bad input, 3: a run-time fault
  such as a hung rank) end the launcher with that code: each rank already printed its one
  line, so torchrun's traceback and failure report would only bury it.
- Nothing else changes: rendezvous, restarts (MAX_RESTARTS), logs and options are torchrun's.

If the agent dies anyway (kill -9), the ranks notice that their parent is gone within a
second, save and exit (dtrain.train.OrphanWatch).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# torchrun's own list plus SIGUSR1, so that the agent survives Slurm's warning signal.
HANDLED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
GRACE_ENV = "DTRAIN_STOP_GRACE_S"
DEFAULT_GRACE_S = 600.0
EXIT_CODES = (2, 3)  # dtrain.errors: bad input, run-time fault


def worker_pids(parent: int | None = None) -> list[int]:
    """The agent's children: torchrun starts each local rank as a direct child."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for task in Path(f"/proc/{parent}/task").glob("*/children"):
        try:
            pids += [int(p) for p in task.read_text().split()]
        except OSError:
            continue
    return sorted(set(pids))


class GracefulStop:
    """The agent's signal handler: the first stop signal is passed on, the rest is torchrun's."""

    def __init__(self, torchrun_handler, grace_s: float):
        self.torchrun_handler, self.grace_s = torchrun_handler, grace_s
        self.signum: int | None = None

    def __call__(self, signum: int, frame) -> None:
        if self.signum is not None or signum not in STOP_SIGNALS:
            return self.torchrun_handler(signum, frame)  # raises SignalException: shut down
        pids = worker_pids()
        if not pids:  # still in rendezvous: no rank to save anything yet
            return self.torchrun_handler(signum, frame)
        self.signum = signum
        name = signal.Signals(signum).name
        print(
            f"dtrain-torchrun: received {name}: the ranks save a checkpoint and stop "
            f"(up to {self.grace_s:g} s, {GRACE_ENV})",
            file=sys.stderr,
            flush=True,
        )
        for pid in pids:
            try:
                os.kill(pid, signum)  # the rank alone: its DataLoader workers stay out of it
            except ProcessLookupError:
                pass
        signal.signal(signal.SIGALRM, self._grace_over)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _grace_over(self, _signum, frame) -> None:
        print(
            f"dtrain-torchrun: ranks still running {self.grace_s:g} s after the stop signal; "
            "shutting them down",
            file=sys.stderr,
            flush=True,
        )
        self.torchrun_handler(self.signum, frame)

    def no_restart(self, restart):
        """Wrap the agent's _restart_workers: a rank that fails while stopping ends the job."""
        stop = self

        def wrapped(agent, worker_group):
            if stop.signum is not None:
                from torch.distributed.elastic.multiprocessing.api import SignalException

                raise SignalException("stopping: no restart", sigval=signal.Signals(stop.signum))
            result = restart(agent, worker_group)
            if stop.signum is not None:  # it came while the old workers were going down
                for pid in worker_pids():
                    os.kill(pid, stop.signum)
            return result

        return wrapped


def user_exit_code(e) -> int | None:
    """dtrain's exit code (2 or 3) if the first rank to fail ended with it and every other one
    ended with it too or was signalled by torchrun's shutdown; else None (a crash)."""
    first = e.get_first_failure()[1].exitcode
    others = {f.exitcode for f in e.failures.values()}
    if first in EXIT_CODES and all(c == first or c < 0 for c in others):
        return first
    return None


def _quiet_user_exit(record: logging.LogRecord) -> bool:
    # torchrun logs "failed (exitcode: 2) local_rank: 0 ..." for a rank that already printed
    # its one line about bad input; that second line only repeats it less clearly.
    args = record.args if isinstance(record.args, tuple) else ()
    return not (str(record.msg).startswith("failed (exitcode") and args[:1] in ((2,), (3,)))


def _grace_s() -> float:
    raw = os.environ.get(GRACE_ENV, str(DEFAULT_GRACE_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        print(f"error: {GRACE_ENV}={raw!r} must be a positive number of seconds", file=sys.stderr)
        sys.exit(2)
    return value


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.elastic.agent.server.api as agent_api
    import torch.distributed.elastic.multiprocessing.api as mp_api
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger(mp_api.__name__).addFilter(_quiet_user_exit)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = torchrun.parse_args(argv)
    if not any(a.split("=")[0].lstrip("-").replace("-", "_") == "signals_to_handle" for a in argv):
        args.signals_to_handle = HANDLED
    stop = GracefulStop(mp_api._terminate_process_handler, _grace_s())
    # PContext.start() installs mp_api._terminate_process_handler by name: ours goes in its place.
    mp_api._terminate_process_handler = stop
    # torch before 2.9 ignores signals_to_handle and never installs one for SIGUSR1.
    signal.signal(signal.SIGUSR1, stop)
    agent_api.SimpleElasticAgent._restart_workers = stop.no_restart(
        agent_api.SimpleElasticAgent._restart_workers
    )
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        code = user_exit_code(e)
        if code is None:
            raise
        return code  # the ranks said why, one line each
    except SignalException as e:  # torchrun's own shutdown ran; its traceback adds nothing
        print(f"dtrain-torchrun: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return 0


def cli() -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())


if __name__ == "__main__":
    cli()
