"""What keeps a run safe and resumable when things go wrong, one file a concern:

faults.py      named fault-injection points (DTRAIN_FAULT) for the fault tests
preemption.py  stop signals (SIGTERM, SIGUSR1, ...) and a launcher that died: save, exit 0
watchdog.py    a hung rank named within trainer.collective_timeout_s
nonfinite.py   NaN/inf steps skipped, or saved and stopped (trainer.on_nonfinite)
rundir.py      one run per run dir (the lock), links refused, what a refused run made undone
safe_write.py  every file written outside checkpoints: no link followed, nothing replaced unasked
"""
