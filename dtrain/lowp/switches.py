"""The low-precision kernels' A/B switches: environment variables (DTRAIN_INT8_*) that choose
between ways of running the same computation, for benchmarks that decide a default. Each is
read where the layers are built, so a bad value stops the run before it starts, in one line."""

from __future__ import annotations

import os

from dtrain.config import say_choices
from dtrain.errors import ConfigError


def env_choice(env: str, choices: tuple[str, ...]) -> str:
    """`env`'s value, one of `choices`: the first when unset or empty; case and surrounding
    spaces ignored. Anything else is a ConfigError naming the variable and the choices."""
    value = os.environ.get(env, "").strip().lower() or choices[0]
    if value not in choices:
        raise ConfigError(f"{env}={value!r} is not valid; choose {say_choices(choices)}")
    return value
