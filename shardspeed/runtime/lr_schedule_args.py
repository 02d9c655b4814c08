"""Reading a `"scheduler"` block and DeepSpeed's LR-schedule command-line flags: the checks every schedule
argument goes through, finding the schedule class a config names, and `add_tuning_arguments` /
`get_config_from_args`. The schedules themselves, and `build_lr_scheduler` that ties these together, are in
`lr_schedules.py` (DeepSpeed's `deepspeed.runtime.lr_schedules`, which re-exports the public names here).
"""

from __future__ import annotations

import argparse
import inspect
import math
from typing import Any

import torch

from shardspeed.config.errors import ConfigError, closest_name, refuse_unknown_keywords
from shardspeed.utils.logging import logger

__all__ = [
    "PARAMS_KEY",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "add_tuning_arguments",
    "as_integer",
    "as_number",
    "check_params",
    "find_schedule",
    "get_config_from_args",
    "per_group",
    "torch_schedule_classes",
    "unwrap_optimizer",
    "warmup_fraction",
    "warmup_type_or_log",
]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
PARAMS_KEY = "scheduler.params"  # the config block every message here names


# --- argument checks: every bad value is a ConfigError naming scheduler.params.<name> -----------------


def as_number(name: str, value: Any, *, minimum: float | None = 0.0, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{PARAMS_KEY}.{name}: expected a number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{PARAMS_KEY}.{name}: must be > 0, got {value!r}")
    if minimum is not None and not value >= minimum:
        raise ConfigError(f"{PARAMS_KEY}.{name}: must be >= {minimum}, got {value!r}")
    return float(value)


def as_integer(name: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigError(f"{PARAMS_KEY}.{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{PARAMS_KEY}.{name}: must be >= {minimum}, got {value!r}")
    return int(value)


def per_group(optimizer: torch.optim.Optimizer, name: str, value: Any) -> list[float]:
    """A scalar repeated for every param group, or a list with one value per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(
                f"{PARAMS_KEY}.{name}: expected {groups} values (one per param group), got {len(value)}"
            )
        return [as_number(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [as_number(name, value)] * groups


def warmup_type_or_log(value: Any) -> str:
    if value in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        return value
    logger.warning(
        f"{PARAMS_KEY}.warmup_type: unknown warmup_type {value!r}; using 'log' (as DeepSpeed does)"
    )
    return WARMUP_LOG_RATE


def warmup_fraction(warmup_type: str, t: int, warmup_steps: int) -> float:
    """How far warm-up has got at iteration t (< warmup_steps): ln(t+1)/ln(W) or t/W."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer itself, looking through a wrapper that exposes it as `.optimizer`."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(
        f"{type(optimizer).__name__} is not a torch.optim.Optimizer (nor wraps one as .optimizer)"
    )


# --- building from config -----------------------------------------------------------------------------


def torch_schedule_classes() -> dict[str, type]:
    """The public schedule classes of `torch.optim.lr_scheduler`, by name."""
    module = torch.optim.lr_scheduler
    bases = (module.LRScheduler, module.ReduceLROnPlateau)
    hidden = {"LRScheduler", "_LRScheduler"}
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, type)
        and issubclass(obj, bases)
        and name not in hidden
        and not name.startswith("_")
    }


def find_schedule(type_name: Any, deepspeed_schedules: dict[str, type]) -> type:
    """The schedule class `type_name` names: one of `deepspeed_schedules` (lower-case name -> class; any case
    matches), else a `torch.optim.lr_scheduler` class (exact name, then any case); ConfigError otherwise."""
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"scheduler.type: expected a schedule name, got {type_name!r}")
    if type_name.lower() in deepspeed_schedules:
        return deepspeed_schedules[type_name.lower()]
    torch_schedules = torch_schedule_classes()
    if type_name in torch_schedules:
        return torch_schedules[type_name]
    folded = {name.lower(): cls for name, cls in torch_schedules.items()}
    if type_name.lower() in folded:
        return folded[type_name.lower()]
    valid = [cls.__name__ for cls in deepspeed_schedules.values()]
    names = valid + sorted(torch_schedules)
    close = closest_name(type_name, names, 0.5)
    hint = f"; did you mean {close!r}?" if close else ""
    raise ConfigError(
        f"scheduler.type: unknown schedule {type_name!r}{hint} Valid: DeepSpeed's {', '.join(valid)} "
        "or any torch.optim.lr_scheduler class"
    )


def check_params(cls: type, params: dict[str, Any]) -> None:
    """ConfigError for a key of `params` that `cls` does not take, or a required argument missing."""
    signature = inspect.signature(cls.__init__)
    arguments = [p for p in list(signature.parameters.values())[2:] if p.kind is not p.VAR_POSITIONAL]
    if any(p.kind is p.VAR_KEYWORD for p in arguments):
        return
    refuse_unknown_keywords(PARAMS_KEY, cls.__name__, params, [p.name for p in arguments])
    missing = [p.name for p in arguments if p.default is p.empty and p.name not in params]
    if missing:
        raise ConfigError(f"{PARAMS_KEY}.{missing[0]}: required by {cls.__name__} but not given")


# --- command-line flags (DeepSpeed's `add_tuning_arguments`) ------------------------------------------


def _str_to_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's LR-schedule flags (`--lr_schedule`, `--lr_range_test_*`, `--cycle_*`, `--warmup_*`)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")
    group.add_argument("--lr_range_test_min_lr", type=float, default=0.001, help="Starting lr value.")
    group.add_argument(
        "--lr_range_test_step_rate", type=float, default=1.0, help="Scaling rate for LR range test."
    )
    group.add_argument(
        "--lr_range_test_step_size", type=int, default=1000, help="Training steps per LR change."
    )
    group.add_argument(
        "--lr_range_test_staircase",
        type=_str_to_bool,
        default=False,
        help="Use staircase scaling for LR range test.",
    )
    group.add_argument(
        "--cycle_first_step_size", type=int, default=1000, help="Size of first step of 1Cycle schedule."
    )
    group.add_argument(
        "--cycle_first_stair_count", type=int, default=-1, help="First stair count for 1Cycle schedule."
    )
    group.add_argument(
        "--cycle_second_step_size", type=int, default=-1, help="Size of second step of 1Cycle schedule."
    )
    group.add_argument(
        "--cycle_second_stair_count", type=int, default=-1, help="Second stair count for 1Cycle."
    )
    group.add_argument(
        "--decay_step_size", type=int, default=1000, help="Size of intervals for post-cycle decay."
    )
    group.add_argument("--cycle_min_lr", type=float, default=0.01, help="1Cycle LR lower bound.")
    group.add_argument("--cycle_max_lr", type=float, default=0.1, help="1Cycle LR upper bound.")
    group.add_argument("--decay_lr_rate", type=float, default=0.0, help="Post-cycle LR decay rate.")
    group.add_argument(
        "--cycle_momentum", default=False, action="store_true", help="Enable 1Cycle momentum schedule."
    )
    group.add_argument("--cycle_min_mom", type=float, default=0.8, help="1Cycle momentum lower bound.")
    group.add_argument("--cycle_max_mom", type=float, default=0.9, help="1Cycle momentum upper bound.")
    group.add_argument("--decay_mom_rate", type=float, default=0.0, help="Post-cycle momentum decay rate.")
    group.add_argument("--warmup_min_lr", type=float, default=0, help="WarmupLR minimum/initial LR value.")
    group.add_argument("--warmup_max_lr", type=float, default=0.001, help="WarmupLR maximum LR value.")
    group.add_argument(
        "--warmup_num_steps", type=int, default=1000, help="WarmupLR step count for LR warmup."
    )
    group.add_argument(
        "--warmup_type", type=str, default=WARMUP_LOG_RATE, help="WarmupLR increasing function."
    )
    return parser


_FLAGS_OF = {
    "LRRangeTest": [
        "lr_range_test_min_lr",
        "lr_range_test_step_rate",
        "lr_range_test_step_size",
        "lr_range_test_staircase",
    ],
    "OneCycle": [
        "cycle_first_step_size",
        "cycle_first_stair_count",
        "cycle_second_step_size",
        "cycle_second_stair_count",
        "decay_step_size",
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
    ],
    "WarmupLR": ["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"],
}


def get_config_from_args(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """`({'type': ..., 'params': {...}}, None)` from the flags of `add_tuning_arguments`, or `(None, why)`.
    -1 (the flags' "unset") for the OneCycle second step size and stair counts means "use the default"."""
    name = getattr(args, "lr_schedule", None)
    if name is None:
        return None, "--lr_schedule not specified on command line"
    if name not in _FLAGS_OF:
        return None, f"{name} is not supported from the command line (supported: {', '.join(_FLAGS_OF)})"
    params = {key: getattr(args, key) for key in _FLAGS_OF[name] if hasattr(args, key)}
    for key in ("cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count"):
        if params.get(key) == -1:
            del params[key]
    return {"type": name, "params": params}, None
