"""Checks across config blocks (a single block's own checks live in its ``validate`` method)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .schema import ShardspeedConfig

__all__ = ["check_all"]


def check_all(cfg: ShardspeedConfig) -> None:
    """Every cross-block rule, in the order a user would want to hear about them."""
    check_precision(cfg)
    check_gradient_predivide(cfg)


def check_precision(cfg: ShardspeedConfig) -> None:
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled: both are true; enable at most one precision")
    if cfg.amp.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        raise ConfigError("amp.enabled: Apex AMP cannot be combined with fp16.enabled or bf16.enabled")
    if cfg.amp.enabled and cfg.zero_enabled:
        raise ConfigError(
            f"amp.enabled: Apex AMP cannot be combined with ZeRO "
            f"(zero_optimization.stage is {cfg.zero_optimization.stage}); use fp16 or bf16 instead"
        )


def check_gradient_predivide(cfg: ShardspeedConfig) -> None:
    zero = cfg.zero_optimization
    if cfg.gradient_predivide_factor != 1.0 and zero.stage in (1, 2) and zero.reduce_scatter:
        raise ConfigError(
            f"gradient_predivide_factor: {cfg.gradient_predivide_factor} is not supported with "
            f"zero_optimization.stage {zero.stage} and zero_optimization.reduce_scatter true; "
            f"set it to 1.0 or set reduce_scatter to false"
        )
