"""The table that non-default variants register into. A variant lives in
dtrain/lowp/experimental/ (its README says what each is for); the core names it here and
imports its module only when the run's config selects it, and the module registers itself."""

from __future__ import annotations

import importlib
from collections.abc import Callable

# The wing's variants by name: the module that registers each.
WING = {"int8_swiglu": "dtrain.lowp.experimental.int8_swiglu"}
_TABLE: dict[str, Callable] = {}


def register(name: str, fn: Callable) -> None:
    """Called by a variant's module when it is imported."""
    _TABLE[name] = fn


def variant(name: str) -> Callable:
    """The function variant `name` registered, its module imported on first use."""
    if name not in _TABLE:
        importlib.import_module(WING[name])
    return _TABLE[name]
