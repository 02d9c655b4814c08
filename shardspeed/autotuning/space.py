"""What the autotuner tries: tuning spaces (ZeRO stage x offload choice) and the config of each experiment.

The user's config says what to search, DeepSpeed's way:

- `zero_optimization.stage`: a stage, a list of stages, or "all" (0-3); absent: stage 0 only (DeepSpeed
  reads a missing stage as 0). Spaces are tried in stage order, as DeepSpeed does.
- `zero_optimization.offload_optimizer.device` / `offload_param.device`: a device or a list of them
  ("none", "cpu", "nvme"); each choice is its own space (`z2_oocpu`, `z3_opnone`, ...), where the stage
  can offload it (the optimizer state at stages 1-3, parameters at stage 3).
- `train_micro_batch_size_per_gpu`: a list of sizes to try as they are; otherwise sizes are searched (see
  autotuner.py) between `min/max_train_micro_batch_size_per_gpu`.
- any other list inside `zero_optimization`: candidate values of that knob when `fast` is false.

Every experiment's config is the user's config with the lists resolved, its stage, offload, micro-batch,
accumulation steps and global batch set (`train_batch_size = micro * accumulation * ranks / mp_size`),
and the `autotuning` block switched on for the engine to measure the run.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from shardspeed.config.features import AutotuningConfig

from .constants import AUTOTUNING, AUTOTUNING_EXPS_DIR, AUTOTUNING_RESULTS_DIR, DEFAULT_TUNING_SPACES
from .dicts import all_combinations, first_values, replace_dict, tuning_keys

__all__ = ["ExperimentConfigs", "TuningSpace", "abbreviation", "knob_space", "spaces_of", "zero_block"]

ZERO = "zero_optimization"
OFFLOADS = (("offload_optimizer", "oo"), ("offload_param", "op"))
STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class TuningSpace:
    """One ZeRO stage with one choice of offload devices (None: the user's block as given)."""

    stage: int
    offload_optimizer: str | None = None
    offload_param: str | None = None

    @property
    def name(self) -> str:
        name = f"z{self.stage}"
        for (_block, short), device in zip(
            OFFLOADS, (self.offload_optimizer, self.offload_param), strict=True
        ):
            if device is not None:
                name += f"_{short}{device}"
        return name


def zero_block(user_config: dict) -> dict:
    """The user's `zero_optimization` object ({} when absent; DeepSpeed's old `true` form means stage 1)."""
    zero = user_config.get(ZERO, {})
    if isinstance(zero, bool):
        return {"stage": 1 if zero else 0}
    if not isinstance(zero, dict):
        raise ValueError(f"{ZERO}: expected an object, got {zero!r}")
    return zero


def _stages(zero: dict) -> list[int]:
    stage = zero.get("stage", 0)
    chosen = list(STAGES) if stage == "all" else stage if isinstance(stage, list) else [stage]
    bad = [s for s in chosen if isinstance(s, bool) or s not in STAGES]
    if bad or not chosen:
        raise ValueError(f'{ZERO}.stage: {stage!r} is not a ZeRO stage, a list of stages or "all"')
    return sorted(set(chosen))


def _devices(zero: dict, block: str) -> list[str | None]:
    """The offload devices to try for `block`: a list given as its device, else the user's as it is."""
    device = zero.get(block, {}).get("device") if isinstance(zero.get(block), dict) else None
    if not isinstance(device, list):
        return [None]
    bad = [d for d in device if d not in ("none", "cpu", "nvme")]
    if bad or not device:
        raise ValueError(f"{ZERO}.{block}.device: {device!r} must list devices among 'none', 'cpu', 'nvme'")
    return list(dict.fromkeys(device))


def spaces_of(user_config: dict) -> list[TuningSpace]:
    """The tuning spaces of a user config, in DeepSpeed's order (stage first)."""
    zero = zero_block(user_config)
    return [
        TuningSpace(stage, oo, op)
        for stage in _stages(zero)
        for oo in _devices(zero, "offload_optimizer")
        for op in _devices(zero, "offload_param")
        if not (op not in (None, "none") and stage != 3)  # parameters are offloaded by stage 3 only
        and not (oo not in (None, "none") and stage == 0)  # optimizer state by stages 1-3 only
    ]


def abbreviation(key: str) -> str:
    """DeepSpeed's short form of a key in experiment names: the first letter of each word."""
    return "".join(word[0] for word in key.split("_") if word)


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, int | float) and value > 9000:
        return f"{value:.1e}"
    return str(value)


def knob_space(user_config: dict, stage: int) -> dict:
    """The ZeRO knobs to tune at `stage` when `fast` is false: DeepSpeed's candidates for the stage, with
    every key the user set (a value or a list of candidates) taking the place of DeepSpeed's."""
    knobs = copy.deepcopy(DEFAULT_TUNING_SPACES[stage][ZERO])
    user = {k: v for k, v in zero_block(user_config).items() if k not in ("stage", *dict(OFFLOADS))}
    replace_dict(knobs, user)
    knobs.pop("stage", None)
    return knobs


class ExperimentConfigs:
    """Builds each experiment's config from the user's (see the module's docstring)."""

    def __init__(self, user_config: dict, block: AutotuningConfig, ranks: int):
        self.user_config = user_config
        self.block = block
        self.ranks = ranks  # ranks of one experiment: nodes x slots

    def config(self, space: TuningSpace, mbs: int, gas: int, knobs: dict | None = None) -> dict:
        config = first_values(self.user_config)
        zero = first_values(zero_block(self.user_config))
        zero["stage"] = space.stage
        for (block, _), device in zip(OFFLOADS, (space.offload_optimizer, space.offload_param), strict=True):
            if device is not None:
                zero[block] = {**zero.get(block, {}), "device": device}
        if space.stage != 3:
            zero.pop("offload_param", None)  # stage 3's key; a stage 0-2 run never reads it
        replace_dict(zero, knobs)
        config[ZERO] = zero
        config["train_micro_batch_size_per_gpu"] = mbs
        config["gradient_accumulation_steps"] = gas
        config["train_batch_size"] = self.train_batch_size(mbs, gas)
        block = {k: v for k, v in (self.user_config.get(AUTOTUNING) or {}).items()
                 if k not in (AUTOTUNING_RESULTS_DIR, AUTOTUNING_EXPS_DIR)}  # fmt: skip
        config[AUTOTUNING] = {**block, "enabled": True}
        return config

    def train_batch_size(self, mbs: int, gas: int) -> int:
        return mbs * gas * self.ranks // self.block.mp_size

    def name(self, space: TuningSpace, mbs: int, gas: int, knobs: dict | None = None) -> str:
        """DeepSpeed's experiment names: z<stage>[_oo<device>][_<knob><value>...]_gas<gas>_tmbspg<mbs>."""
        parts = [space.name]
        for key in sorted(knobs or {}):
            parts.append(f"{abbreviation(key)}{_value_text(knobs[key])}")
        return "_".join([*parts, f"gas{gas}", f"tmbspg{mbs}"])

    def knob_choices(self, stage: int) -> tuple[list[str], list[dict]]:
        """(the knobs with several candidates, every combination of the knob space) for `fast: false`."""
        space = knob_space(self.user_config, stage)
        return sorted(tuning_keys(space)), all_combinations(space)
