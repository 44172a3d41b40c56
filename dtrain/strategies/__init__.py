"""The one registry of strategies: strategy=<name> -> its class, for every Strategy defined in a
module of this package, under each of its `names`. A new strategy is a new file here."""

from __future__ import annotations

import importlib
import pkgutil

from dtrain.config import ModelConfig, ParallelConfig, StrategyConfig
from dtrain.dist import DistEnv
from dtrain.errors import ConfigError
from dtrain.precision import Precision
from dtrain.strategies.base import Collective, MemoryFacts, SpeedFacts, StateBytes, Strategy


def _discover() -> dict[str, type[Strategy]]:
    found: dict[str, type[Strategy]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            defined_here = getattr(obj, "__module__", None) == module.__name__
            if defined_here and isinstance(obj, type) and issubclass(obj, Strategy):
                found.update(dict.fromkeys(obj.names, obj))
    return found


STRATEGIES: dict[str, type[Strategy]] = _discover()


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy '{name}'; valid choices: {', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[name]


def check_parallel(
    cfg: StrategyConfig,
    parallel: ParallelConfig,
    precision: Precision | None,
    *,
    world_size: int,
    model: ModelConfig,
    seq_len: int,
) -> None:
    """parallel.tp and parallel.cp: a strategy that composes with them, a layout that divides
    the world, the heads and the sequence, and what that strategy refuses beside them (the
    precision's part where one is given: before the run, none is built yet)."""
    from dtrain.parallel.mesh import check_layout, is_parallel

    if not is_parallel(parallel):
        return
    cls = strategy_class(cfg.name)
    if not cls.composes_parallel:
        valid = sorted({c.name for c in STRATEGIES.values() if c.composes_parallel})
        raise ConfigError(
            f"strategy={cfg.name} does not compose with parallel.tp={parallel.tp}, "
            f"parallel.cp={parallel.cp}; choose strategy={' or '.join(valid)} "
            "(or parallel.tp=1 parallel.cp=1)"
        )
    check_layout(parallel, world_size, model, seq_len)
    cls.check_parallel(cfg, precision)


def build_strategy(cfg: StrategyConfig, precision: Precision, env: DistEnv) -> Strategy:
    return strategy_class(cfg.name)(cfg, precision, env)  # its check() refuses what it cannot run


__all__ = [
    "STRATEGIES",
    "Collective",
    "MemoryFacts",
    "SpeedFacts",
    "StateBytes",
    "Strategy",
    "build_strategy",
    "check_parallel",
    "strategy_class",
]
