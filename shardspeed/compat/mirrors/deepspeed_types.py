"""DeepSpeed's small public types that have no counterpart elsewhere in shardspeed: enums and an exception.

Code written for DeepSpeed compares the ZeRO stage with `ZeroStageEnum.weights`, names offload devices
and catches `ZeRORuntimeException`; these carry the same names and values so
that such code runs unchanged (shardspeed's config stores the stage as an int, which compares equal to these). The offload enums
live with the offload blocks (runtime/zero/offload_config.py).
"""

from __future__ import annotations

import enum

__all__ = ["ZeRORuntimeException", "ZeroStageEnum"]


class ZeroStageEnum(enum.IntEnum):
    """The ZeRO stages by what they partition (an int: `ZeroStageEnum.weights == 3`)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO error class, for code that catches it."""
