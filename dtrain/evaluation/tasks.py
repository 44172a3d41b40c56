"""The downstream tasks by name (config.DownstreamTask lists the same names): each builds its items
from a count and a seed, the same items for the same arguments."""

from __future__ import annotations

from collections.abc import Callable

from dtrain.errors import ConfigError
from dtrain.evaluation.brackets import brackets
from dtrain.evaluation.cloze import stdlib_cloze
from dtrain.evaluation.items import Item

TASKS: dict[str, Callable[[int, int], list[Item]]] = {
    "stdlib_cloze": stdlib_cloze,
    "brackets": brackets,
}


def build_tasks(names: list[str], n: int, seed: int) -> dict[str, list[Item]]:
    """{task: its n items}; an unknown name is a ConfigError naming the valid ones."""
    out = {}
    for name in names:
        if name not in TASKS:
            raise ConfigError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
        out[name] = TASKS[name](n, seed)
    return out
