"""DeepSpeed's `deepspeed.runtime.zero.offload_config` enums: offload devices and the kinds of engine state.

`OffloadDeviceEnum` names where the ZeRO offload blocks put things (their `device` key takes the same
strings); `OffloadStateTypeEnum` names what `engine.offload_states(include=...)` moves
(runtime/zero/offload_states.py). Both are `str` enums: `"cpu" == OffloadDeviceEnum.cpu`.
"""

from __future__ import annotations

import enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, enum.Enum):
    """Offload devices."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """Kinds of engine state `offload_states` moves."""

    optim_states = "optim_states"  # the optimizer's per-parameter state (Adam's moments)
    hp_params = "hp_params"  # fp32 master weights
    lp_params = "lp_params"  # the module's (low-precision) parameters
    lp_grads = "lp_grads"  # reduced gradient shards (ZeRO 2-3)
    contiguous_grad_buffer = "contiguous_grad_buffer"  # full gradient buckets (ZeRO 0-1)
