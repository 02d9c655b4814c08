"""`RandomLTDScheduler`: how many tokens random-LTD layers keep at each step, and the layer-tokens consumed.

The kept length grows linearly (DeepSpeed's only schedule, `fixed_linear`) from `min_value` at step 0 to
`max_value` at `require_steps`, floored to a multiple of `seq_per_step`, as DeepSpeed 0.19.8 computes it.
`update_seq(step)` is called by the engine before every training forward; the first call for a step also adds
the step's layer-tokens to `consumed_layer_tokens`: global batch x (kept length x dropping layers + full
length x the other layers). The scheduler also carries, between the layers of one forward, the positions the
first dropping layer drew (`state["sample_idx"]`) and the cut mask (`state["attention_mask"]`).
"""

from __future__ import annotations

import math
from typing import Any

from shardspeed.config.data_efficiency import RandomLtdConfig

__all__ = ["RandomLTDScheduler"]

# the entries of `state` that are saved in checkpoints (DeepSpeed's keys)
_SAVED = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")


class RandomLTDScheduler:
    """`config`: the `random_ltd` block (typed, or DeepSpeed's dict, which also carries the engine's
    `global_batch_size` and `micro_batch_size`); `global_batch_size` overrides the dict's."""

    def __init__(self, config: RandomLtdConfig | dict[str, Any], global_batch_size: int | None = None):
        if isinstance(config, dict):
            config, global_batch_size = _from_dict(config, global_batch_size)
        if global_batch_size is None:
            raise ValueError("RandomLTDScheduler needs the global batch size (train_batch_size)")
        self.config = config
        self.model_layer_num = config.total_layer_num
        self.random_ltd_layer_num = config.random_ltd_layer_num
        self.config_schedule = config.random_ltd_schedule
        self.global_batch_size = global_batch_size
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        schedule = self.config_schedule
        self.state.update(
            min_value=schedule.min_value, max_value=schedule.max_value, current_value=schedule.min_value,
            schedule_config=schedule.schedule_config, schedule_type=schedule.schedule_type,
            consumed_layer_tokens=0, current_steps=-1,
        )  # fmt: skip

    def get_value(self, global_steps: int) -> int:
        """The kept length of the schedule at `global_steps`."""
        params = self.state["schedule_config"]
        low, high = self.state["min_value"], self.state["max_value"]
        value = math.floor(float(global_steps) / params.require_steps * (high - low) + low)
        value -= value % params.seq_per_step
        return min(value, high)

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer-tokens consumed after `train_iters` steps from here (advances the scheduler, as DeepSpeed's)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state["consumed_layer_tokens"]

    def update_seq(self, global_steps: int) -> None:
        state = self.state
        if state["current_value"] < state["max_value"]:
            state["current_value"] = self.get_value(global_steps)
        if global_steps != state["current_steps"]:
            full_layers = self.model_layer_num - self.random_ltd_layer_num
            per_sample = state["current_value"] * self.random_ltd_layer_num + state["max_value"] * full_layers
            state["consumed_layer_tokens"] += self.global_batch_size * per_sample
            state["current_steps"] = global_steps

    def state_dict(self) -> dict[str, int]:
        return {key: self.state[key] for key in _SAVED}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.state.update({key: state_dict[key] for key in _SAVED})


def _from_dict(config: dict[str, Any], global_batch_size: int | None):
    from shardspeed.config.build import BuildContext, build_block

    keys = dict(config)
    batch = keys.pop("global_batch_size", None)
    keys.pop("micro_batch_size", None)
    keys.setdefault("enabled", True)
    block = build_block(RandomLtdConfig, keys, "data_efficiency.data_routing.random_ltd", BuildContext())
    return block, global_batch_size if global_batch_size is not None else batch
