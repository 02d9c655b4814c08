"""How ZenFlow would split a rank's CPU cores between training and an overlapped optimizer (`split_affinity`).

DeepSpeed's overlapped variant (`zenflow.overlap_step: true`) runs the offloaded optimizer in a separate
process pinned to part of the rank's cores, keeping `pt_reserved_cores_perc` of them for PyTorch's own
threads. shardspeed does not build that variant (the config refuses `overlap_step: true`), but the split rule
is a plain function DeepSpeed's tests check, so it is here with DeepSpeed's meaning.
"""

from __future__ import annotations

import math

__all__ = ["split_affinity"]


def split_affinity(cores: list[int], pt_reserved_cores_perc: float) -> tuple[list[int], list[int]]:
    """(optimizer cores, training cores): the first ceil(perc * n) cores train, the rest run the optimizer.
    When that reserve is empty or takes every core, nothing is isolated: both sides get the full list."""
    reserved = math.ceil(pt_reserved_cores_perc * len(cores))
    if 0 < reserved < len(cores):
        return list(cores[reserved:]), list(cores[:reserved])
    return list(cores), list(cores)
