"""Resolve the optimizer and LR scheduler a run uses: the client's (instance or callable) or the config's.

As in DeepSpeed, an optimizer or scheduler passed to `initialize` overrides the config block, and a
callable receives the parameters (optimizer) or the unwrapped torch optimizer (scheduler).
"""

from __future__ import annotations

import torch

from shardspeed.config import ConfigError
from shardspeed.runtime.lr_schedules import build_lr_scheduler
from shardspeed.runtime.optim import build_optimizer
from shardspeed.utils.logging import log_dist


def resolve_optimizer(client_optimizer, model_parameters, cfg) -> torch.optim.Optimizer | None:
    if isinstance(client_optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            log_dist("optimizer given to initialize() overrides the config's 'optimizer' block")
        return client_optimizer
    if callable(client_optimizer):
        optimizer = client_optimizer(model_parameters)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable passed to initialize() returned {type(optimizer).__name__}, "
                "expected a torch.optim.Optimizer"
            )
        return optimizer
    if client_optimizer is not None:
        raise TypeError(
            f"initialize(optimizer=...) takes a torch.optim.Optimizer or a callable, got {type(client_optimizer).__name__}"
        )
    if cfg.optimizer is None:
        return None
    offload = cfg.zero_optimization.offload_optimizer is not None and (
        cfg.zero_optimization.offload_optimizer.device != "none"
    )
    return build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), model_parameters, offload=offload)


def resolve_lr_scheduler(client_scheduler, optimizer: torch.optim.Optimizer | None, cfg):
    if (
        client_scheduler is not None
        and not callable(client_scheduler)
        and not hasattr(client_scheduler, "step")
    ):
        raise TypeError(
            f"initialize(lr_scheduler=...) takes a scheduler or a callable, got {type(client_scheduler).__name__}"
        )
    if client_scheduler is not None and hasattr(client_scheduler, "step"):
        return client_scheduler
    if client_scheduler is not None:
        if optimizer is None:
            raise ConfigError("lr_scheduler: a scheduler callable was given but there is no optimizer")
        return client_scheduler(optimizer)
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError("scheduler: a 'scheduler' block needs an optimizer (config 'optimizer' or client)")
    return build_lr_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), optimizer)


def check_config_blocks(cfg, client_optimizer, client_scheduler, model_parameters) -> None:
    """Refuse a bad `optimizer` or `scheduler` block (ConfigError naming its key) before anything is built:
    the blocks the run will use are built once over throwaway parameters, one per parameter group."""
    if client_optimizer is None and cfg.optimizer is None:
        if client_scheduler is None and cfg.scheduler is not None:
            raise ConfigError(
                "scheduler: a 'scheduler' block needs an optimizer (config 'optimizer' or client)"
            )
        return
    if client_optimizer is not None:
        return  # the client's optimizer replaces the block; a scheduler then needs the real one to check
    probe = resolve_optimizer(None, _probe_groups(model_parameters), cfg)
    if client_scheduler is None and cfg.scheduler is not None:
        resolve_lr_scheduler(None, probe, cfg)


def _probe_groups(model_parameters) -> list:
    """One one-element parameter per group of `model_parameters`, each group keeping its own options."""
    groups = list(model_parameters) if model_parameters is not None else []
    if groups and all(isinstance(g, dict) for g in groups):
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [torch.nn.Parameter(torch.zeros(1))]}
            for g in groups
        ]
    return [torch.nn.Parameter(torch.zeros(1))]
