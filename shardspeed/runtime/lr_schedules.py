"""DeepSpeed's LR schedules with DeepSpeed's formulas, and `build_lr_scheduler` for the config's
`"scheduler"` block.

Every schedule counts optimizer steps in `last_batch_iteration` (t): -1 after construction, 0 after the first
`step()`. Construction already writes the schedule's starting lr into the optimizer (the engine steps the
optimizer before the schedule, so the first update uses it). `state_dict()` is DeepSpeed's
`{'last_batch_iteration': t}` (plus the base lrs for WarmupCosineLR); `load_state_dict` restores t and writes
the lr for t back into the optimizer, so a resumed run continues exactly.

Differences from DeepSpeed, on purpose (docs/compatibility.md):
* OneCycle's momentum cycling keeps each group's own beta2 (DeepSpeed overwrites it with 0.99) and cycles
  `momentum` for optimizers without `betas` such as SGD (DeepSpeed disables cycling there).
* WarmupCosineLR holds `cos_min_ratio` after `total_num_steps` (DeepSpeed's cosine climbs back up), and
  starts at `warmup_min_ratio * lr` at construction.
* `get_last_lr()` works before the first `step()`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardspeed.config.errors import ConfigError
from shardspeed.runtime.lr_schedule_args import (  # the public ones re-exported under DeepSpeed's path
    PARAMS_KEY,
    WARMUP_LINEAR_RATE,  # noqa: F401
    WARMUP_LOG_RATE,
    add_tuning_arguments,
    as_integer,
    as_number,
    check_params,
    find_schedule,
    get_config_from_args,
    per_group,
    unwrap_optimizer,
    warmup_fraction,
    warmup_type_or_log,
)
from shardspeed.utils.logging import logger

__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "add_tuning_arguments",
    "build_lr_scheduler",
    "get_config_from_args",
]


def _stair(fraction: float, stairs: int | None) -> float:
    """`fraction` (0..1 of a half cycle) held flat over `stairs` equal steps (0 or None: continuous). The
    tolerance keeps a fraction that lands on a stair edge (1.0 at the peak) from rounding down a stair."""
    if not stairs:
        return fraction
    return math.floor(fraction * stairs + 1e-9) / stairs


# --- the schedules ------------------------------------------------------------------------------------


class _Schedule:
    """What every DeepSpeed schedule shares: the iteration counter, writing lrs, state_dict."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = unwrap_optimizer(optimizer)
        self.last_batch_iteration = as_integer("last_batch_iteration", last_batch_iteration, minimum=-1)
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        """The lr of every param group at the current iteration (does not write them)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None, *, batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to the given one) and write its lrs into the optimizer.
        `batch_iteration` is the keyword DeepSpeed's LRRangeTest and OneCycle use for the same thing."""
        target = last_batch_iteration if last_batch_iteration is not None else batch_iteration
        self.last_batch_iteration = self.last_batch_iteration + 1 if target is None else int(target)
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if torch.is_tensor(group["lr"]):  # a tensor lr (for compiled steps) is filled in place: the
                group["lr"].fill_(float(lr))  # optimizer and the caller keep holding the same tensor
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()


class LRRangeTest(_Schedule):
    """LR range test: `lr = min_lr * (1 + step_rate * i)` with `i = (t + 1) / step_size`, floored when
    `lr_range_test_staircase`. `lr_range_test_min_lr` may be a list, one per param group."""

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group(self.optimizer, "lr_range_test_min_lr", lr_range_test_min_lr)
        self.step_size = as_number("lr_range_test_step_size", lr_range_test_step_size, positive=True)
        self.step_rate = as_number("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def _interval(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(interval)) if self.staircase else interval

    def get_lr(self) -> list[float]:
        increase = 1.0 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: lr rises min→max over `cycle_first_step_size` iterations and falls back over
    `cycle_second_step_size`, then decays as `min_lr / (1 + decay_lr_rate * d / decay_step_size)`.
    With `cycle_momentum`, beta1 (or `momentum`) moves the opposite way between `cycle_max_mom` and
    `cycle_min_mom`, then grows as `max_mom * (1 + decay_mom_rate * d / decay_step_size)`. Lrs and momenta
    may be per-group lists. `cycle_first_stair_count` / `cycle_second_stair_count` hold each half's value
    flat over that many equal stairs (0: continuous). A second half of 0 iterations is allowed."""

    def __init__(
        self,
        optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = as_number("cycle_first_step_size", cycle_first_step_size, positive=True)
        second = first if cycle_second_step_size is None else cycle_second_step_size
        second = as_number("cycle_second_step_size", second)
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = as_number("decay_step_size", decay_step_size)
        self.min_lrs = per_group(self.optimizer, "cycle_min_lr", cycle_min_lr)
        self.max_lrs = per_group(self.optimizer, "cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate = as_number("decay_lr_rate", decay_lr_rate, minimum=None)
        self.min_moms = per_group(self.optimizer, "cycle_min_mom", cycle_min_mom)
        self.max_moms = per_group(self.optimizer, "cycle_max_mom", cycle_max_mom)
        self.decay_mom_rate = as_number("decay_mom_rate", decay_mom_rate, minimum=None)
        self.skip_lr_decay = self.decay_step_size == 0 or self.decay_lr_rate == 0
        self.skip_mom_decay = self.decay_step_size == 0 or self.decay_mom_rate == 0
        self.momentum_key = self._momentum_key() if cycle_momentum else None
        self.cycle_momentum = self.momentum_key is not None
        self._apply()
        if self.last_batch_iteration == -1 and self.cycle_momentum:
            # As DeepSpeed: the optimizer starts at the *minimum* momentum, before the first step().
            self._write_momentum(list(self.min_moms))

    def _momentum_key(self) -> str | None:
        defaults = self.optimizer.defaults
        if "betas" in defaults:
            return "betas"
        if "momentum" in defaults:
            return "momentum"
        logger.warning(
            f"OneCycle: cycle_momentum is disabled because {type(self.optimizer).__name__} has neither "
            "betas nor momentum"
        )
        return None

    def _scale_factor(self) -> float:
        iteration = self.last_batch_iteration + 1
        x = 1.0 + iteration / self.total_size - math.floor(1.0 + iteration / self.total_size)
        if x <= self.step_ratio:
            return _stair(x / self.step_ratio, self.first_stair_count)
        return 1.0 - _stair((x - self.step_ratio) / (1.0 - self.step_ratio), self.second_stair_count)

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def _momenta(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        return [hi * (1.0 + self.decay_mom_rate * self._decay_interval()) for hi in self.max_moms]

    def get_mom(self) -> list | None:
        """Every group's momentum at the current iteration, as DeepSpeed reports it: `(beta1, beta2)` for
        Adam-style optimizers, the `momentum` value otherwise; None without momentum cycling."""
        if not self.cycle_momentum:
            return None
        momenta = self._momenta()
        if self.momentum_key == "betas":
            return [(m, group["betas"][1]) for m, group in zip(momenta, self.optimizer.param_groups)]
        return momenta

    def _write_momentum(self, momenta: list[float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, momenta):
            if self.momentum_key == "betas":
                group["betas"] = (momentum, group["betas"][1])
            else:
                group["momentum"] = momentum

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_momentum(self._momenta())


class WarmupLR(_Schedule):
    """Warm-up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps` (at least 2) iterations,
    logarithmic (`ln(t+1)/ln(W)`) or linear (`t/W`), then constant. Min and max may be per-group lists;
    without `warmup_max_lr` each group warms up to its own lr (as DeepSpeed 0.19)."""

    def __init__(
        self,
        optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:  # DeepSpeed 0.19: each group warms up to its own lr
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, "warmup_min_lr", warmup_min_lr)
        self.max_lrs = per_group(self.optimizer, "warmup_max_lr", warmup_max_lr)
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = max(2, as_integer("warmup_num_steps", warmup_num_steps))
        self.warmup_type = warmup_type_or_log(warmup_type)
        self._setup()
        self._apply()

    def _setup(self) -> None:
        """Hook for subclasses to check their own arguments before the first lr is written."""

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_fraction(self.warmup_type, self.last_batch_iteration, self.warmup_num_steps)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at `total_num_steps`: `gamma = max(0, (T - t) / max(1, T - W))`."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = as_integer("total_num_steps", total_num_steps, minimum=1)
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _setup(self) -> None:
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                f"WarmupDecayLR: total_num_steps {self.total_num_steps} is less than "
                f"warmup_num_steps {self.warmup_num_steps}"
            )

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return warmup_fraction(self.warmup_type, t, self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Multiplies each group's lr at construction by a ratio: warm-up from `warmup_min_ratio` to 1 over
    `warmup_num_steps` (log or linear), then cosine decay to `cos_min_ratio` at `total_num_steps`, held
    there afterwards."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = as_integer("total_num_steps", total_num_steps, minimum=1)
        self.warmup_min_ratio = as_number("warmup_min_ratio", warmup_min_ratio)
        self.warmup_num_steps = max(2, as_integer("warmup_num_steps", warmup_num_steps))
        self.cos_min_ratio = as_number("cos_min_ratio", cos_min_ratio)
        self.warmup_type = warmup_type_or_log(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                f"WarmupCosineLR: total_num_steps {self.total_num_steps} is less than "
                f"warmup_num_steps {self.warmup_num_steps}"
            )
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return self.warmup_min_ratio
        if t < self.warmup_num_steps:
            fraction = warmup_fraction(self.warmup_type, t, self.warmup_num_steps)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        progress = (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * min(1.0, progress))) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A DeepSpeed checkpoint has no org_lrs: keep the ones read at construction.
        self.org_lrs = list(state_dict.get("org_lrs", self.org_lrs))
        super().load_state_dict(state_dict)


VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
_DEEPSPEED_SCHEDULES = {
    cls.__name__.lower(): cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def build_lr_scheduler(type_name: str, params: dict[str, Any] | None, optimizer: Any):
    """The schedule named by the config's `scheduler.type` with `scheduler.params`, over `optimizer`
    (a torch optimizer or a wrapper exposing one as `.optimizer`). DeepSpeed's schedule names are matched
    case-insensitively first, then `torch.optim.lr_scheduler` classes (exact name, then any case)."""
    cls = find_schedule(type_name, _DEEPSPEED_SCHEDULES)
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"scheduler.params: expected an object, got {params!r}")
    params = dict(params or {})
    check_params(cls, params)
    if cls in _DEEPSPEED_SCHEDULES.values():
        return cls(optimizer, **params)
    try:
        return cls(unwrap_optimizer(optimizer), **params)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{PARAMS_KEY}: {cls.__name__} refused {params}: {error}") from error
