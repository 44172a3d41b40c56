"""Strategy registry: strategy=<name> -> its class. One file per strategy."""

from __future__ import annotations

from dtrain.config import StrategyConfig
from dtrain.dist import DistEnv
from dtrain.errors import ConfigError
from dtrain.precision import Precision
from dtrain.strategies.base import StateBytes, Strategy
from dtrain.strategies.ddp import DDPStrategy
from dtrain.strategies.single import SingleStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleStrategy,
    "ddp": DDPStrategy,
}


def build_strategy(cfg: StrategyConfig, precision: Precision, env: DistEnv) -> Strategy:
    if cfg.name not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy '{cfg.name}'; valid choices: {', '.join(sorted(STRATEGIES))}"
        )
    cls = STRATEGIES[cfg.name]
    if env.world_size > 1 and not cls.needs_distributed:
        raise ConfigError(
            f"strategy={cfg.name} runs one process but WORLD_SIZE={env.world_size}; "
            f"use strategy=ddp (or another multi-rank strategy) under torchrun"
        )
    return cls(cfg, precision, env)


__all__ = ["STRATEGIES", "StateBytes", "Strategy", "build_strategy"]
