"""Strategy registry: strategy=<name> -> its class. One file per strategy."""

from __future__ import annotations

from dtrain.config import StrategyConfig
from dtrain.dist import DistEnv
from dtrain.errors import ConfigError
from dtrain.precision import Precision
from dtrain.strategies.base import StateBytes, Strategy
from dtrain.strategies.ddp import DDPStrategy
from dtrain.strategies.deepspeed import DeepSpeedStrategy
from dtrain.strategies.fsdp import FSDPStrategy
from dtrain.strategies.single import SingleStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "hsdp": FSDPStrategy,  # fsdp with replicate_degree > 1 (conf/strategy/hsdp.yaml)
    # One DeepSpeed class for every ZeRO stage; zero1/2/3 are deepspeed with the stage set.
    "deepspeed": DeepSpeedStrategy,
    "zero1": DeepSpeedStrategy,
    "zero2": DeepSpeedStrategy,
    "zero3": DeepSpeedStrategy,
}


def build_strategy(cfg: StrategyConfig, precision: Precision, env: DistEnv) -> Strategy:
    if cfg.name not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy '{cfg.name}'; valid choices: {', '.join(sorted(STRATEGIES))}"
        )
    return STRATEGIES[cfg.name](cfg, precision, env)  # its check() refuses what it cannot run


__all__ = ["STRATEGIES", "StateBytes", "Strategy", "build_strategy"]
