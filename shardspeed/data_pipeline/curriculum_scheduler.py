"""`CurriculumScheduler`: the difficulty a curriculum allows at a step (DeepSpeed's pacing functions and values).

Four schedules, as in DeepSpeed 0.19.8:

- `fixed_linear`: difficulty grows linearly from `min_difficulty` at step 0 to `max_difficulty` at
  `total_curriculum_step`, floored to a multiple of `difficulty_step`;
- `fixed_root`: the same along `(step / total) ** (1 / root_degree)` (2: a square root, fast at first);
- `fixed_discrete`: `difficulty[i]` up to step `max_step[i]`, the last difficulty after the last max_step;
- `custom`: a function `step -> difficulty` the script sets (`engine.set_custom_curriculum_learning_schedule`).

As in DeepSpeed, a floored difficulty never starts below `min_difficulty` rounded up to a multiple of
`difficulty_step` (a zero-length sequence is no curriculum), and never exceeds `max_difficulty`; once the
current difficulty reaches the maximum it stays there. The scheduler's state is the current difficulty
(`state_dict`), which is all a resumed run needs: the schedule itself is a function of the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from shardspeed.config.data_efficiency import (
    CurriculumMetricConfig,
    CurriculumScheduleConfig,
    LegacyCurriculumConfig,
)
from shardspeed.utils.logging import logger

__all__ = ["CurriculumScheduler"]

_TENSOR_CORE_NOTE = (
    "curriculum difficulty_step {step} is not a multiple of 8: with the seqlen metric, sequence lengths that "
    "are multiples of 8 (fp16) or 16 (int8) let NVIDIA Tensor Cores be used; ignore this for other metrics"
)


class CurriculumScheduler:
    """The difficulty of a curriculum at each step. `config`: a metric's curriculum block, the legacy
    `curriculum_learning` block, or DeepSpeed's dict of the same keys (checked as the config loader does)."""

    def __init__(self, config: CurriculumMetricConfig | LegacyCurriculumConfig | dict[str, Any]):
        if isinstance(config, dict):
            config = _from_dict(config)
        self.min_difficulty: int = config.min_difficulty
        self.max_difficulty: int = config.max_difficulty
        self.schedule_type: str = config.schedule_type
        self.schedule: CurriculumScheduleConfig = config.schedule_config
        self.current_difficulty: int = config.min_difficulty
        self.custom_get_difficulty: Callable[[int], int] | None = None
        step = self.schedule.difficulty_step
        if self.schedule_type in ("fixed_linear", "fixed_root") and step % 8 != 0:
            logger.warning(_TENSOR_CORE_NOTE.format(step=step))

    # -- DeepSpeed's API -----------------------------------------------------------------------------------

    @property
    def state(self) -> dict[str, Any]:
        """DeepSpeed's `state` dict (read-only view; `set_state` replaces the current difficulty)."""
        return {
            "min_difficulty": self.min_difficulty,
            "max_difficulty": self.max_difficulty,
            "current_difficulty": self.current_difficulty,
            "schedule_type": self.schedule_type,
        }

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        self.custom_get_difficulty = schedule_function

    def get_current_difficulty(self) -> int:
        return self.current_difficulty

    def set_current_difficulty(self, difficulty: int) -> None:
        self.current_difficulty = difficulty

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.current_difficulty = state["current_difficulty"]

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at `global_steps` (whatever the current difficulty is)."""
        if self.schedule_type == "fixed_discrete":
            return self._discrete(global_steps)
        if self.schedule_type == "fixed_linear":
            return self._root(global_steps, 1)
        if self.schedule_type == "fixed_root":
            return self._root(global_steps, self.schedule.root_degree)
        if self.custom_get_difficulty is None:
            raise RuntimeError(
                "curriculum schedule_type 'custom' needs a schedule function: call "
                "engine.set_custom_curriculum_learning_schedule({metric: fn}) (or set_custom_get_difficulty) "
                "before training"
            )
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Move to the difficulty of `global_steps` unless the maximum was reached; the current difficulty."""
        if self.current_difficulty < self.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty

    # -- checkpoint state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"current_difficulty": self.current_difficulty}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.current_difficulty = state["current_difficulty"]

    # -- the pacing functions ------------------------------------------------------------------------------

    def _discrete(self, global_steps: int) -> int:
        difficulty, max_step = self.schedule.difficulty, self.schedule.max_step
        for i, last_step in enumerate(max_step):
            if global_steps <= last_step:
                return difficulty[i]
        return difficulty[-1]

    def _root(self, global_steps: int, root_degree: int) -> int:
        step = self.schedule.difficulty_step
        progress = (float(global_steps) / self.schedule.total_curriculum_step) ** (1.0 / root_degree)
        value = math.floor(progress * (self.max_difficulty - self.min_difficulty) + self.min_difficulty)
        value -= value % step
        value = max(value, -(-self.min_difficulty // step) * step)  # the first multiple of step >= min
        return min(value, self.max_difficulty)


def _from_dict(config: dict[str, Any]):
    """A DeepSpeed curriculum dict as a checked block (`enabled` is implied: a scheduler is being built)."""
    from shardspeed.config.build import BuildContext, build_block

    keys = dict(config)
    keys.pop("enabled", None)
    if "curriculum_type" in keys or not {"difficulty_type", "clustering_type"} <= keys.keys():
        keys.pop("curriculum_type", None)
        data = {**keys, "enabled": True}
        return build_block(LegacyCurriculumConfig, data, "curriculum_learning", BuildContext())
    return build_block(CurriculumMetricConfig, keys, "curriculum_metrics.<metric>", BuildContext())
