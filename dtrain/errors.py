"""Errors meant for people: each carries one line that names the bad value and the valid choices.

The launcher prints `error: <message>` and exits with code 2, no traceback. Anything else that
raises is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Base of the errors caused by input (config, data, checkpoint, command line)."""

    exit_code = 2


class ConfigError(UserError):
    """A config value is unknown, out of range, or inconsistent with another."""


class DataError(UserError):
    """Training data is missing, empty, unreadable or malformed."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt or belongs to another run."""


class FaultError(Exception):
    """The run stopped because something failed at run time (a rank hung, non-finite
    gradients with trainer.on_nonfinite=stop): one line naming it, exit code 3."""

    exit_code = 3
    every_rank = False  # True when ranks see different things (a hang): each one reports


def fail(err: UserError | FaultError, rank0_only: bool = True) -> None:
    """Print `error: <one line>` on stderr (rank 0 only under torchrun) and exit with code 2."""
    import os
    import sys

    if not rank0_only or os.environ.get("RANK", "0") == "0":
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(getattr(err, "exit_code", 2))
