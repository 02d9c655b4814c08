"""DeepSpeed's `autotuning.config`: `DeepSpeedAutotuningConfig(ds_config)` and the block's key names.

DeepSpeed code builds the block from a whole config dict and reads it as attributes. Here it is the one
config system's `AutotuningConfig`, built and checked as `initialize` checks it (unknown keys, types, a
refused `tuner_type: "model_based"` or `model_info`, all named), with its fields as attributes. The key
names and defaults (`AUTOTUNING`, `AUTOTUNING_METRIC_DEFAULT`, ...) are those of `autotuning.constants`,
which DeepSpeed's module re-exports.
"""

from __future__ import annotations

import dataclasses

from shardspeed.autotuning.constants import *  # noqa: F403 - DeepSpeed's module re-exports its constants
from shardspeed.autotuning.constants import AUTOTUNING
from shardspeed.config.build import BuildContext, build_block
from shardspeed.config.features import AutotuningConfig

__all__ = ["DeepSpeedAutotuningConfig"]


class DeepSpeedAutotuningConfig:
    """`DeepSpeedAutotuningConfig(param_dict)`: the `autotuning` block of `param_dict`, checked."""

    def __init__(self, param_dict: dict | None):
        block = (param_dict or {}).get(AUTOTUNING) or {}
        built = build_block(AutotuningConfig, block, AUTOTUNING, BuildContext())
        for f in dataclasses.fields(AutotuningConfig):
            setattr(self, f.name, getattr(built, f.name))
