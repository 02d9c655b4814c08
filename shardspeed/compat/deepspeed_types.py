"""DeepSpeed's small public types that have no counterpart elsewhere in shardspeed: enums and an exception.

Code written for DeepSpeed compares the ZeRO stage with `ZeroStageEnum.weights`, names offload devices
with `OffloadDeviceEnum.cpu` and catches `ZeRORuntimeException`; these carry the same names and values so
that such code runs unchanged (shardspeed's config stores the stage as an int and the device as a string,
which compare equal to these).
"""

from __future__ import annotations

import enum

__all__ = ["OffloadDeviceEnum", "ZeRORuntimeException", "ZeroStageEnum"]


class ZeroStageEnum(enum.IntEnum):
    """The ZeRO stages by what they partition (an int: `ZeroStageEnum.weights == 3`)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded state lives (a str: `OffloadDeviceEnum.cpu == "cpu"`)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO error class, for code that catches it."""
