"""`build_parallel_grid`: the process grid `initialize` builds when the config asks for model parallelism.

Sequence parallelism (`sequence_parallel_size` > 1) lays ranks out as (data, sequence) with the sequence axis
varying fastest, so a sequence group is consecutive ranks, as in DeepSpeed (world 4, sp 2: sequence groups
[0, 1] and [2, 3], data groups [0, 2] and [1, 3]).
"""

from __future__ import annotations

import torch.distributed as dist

from shardspeed.comm.topology import ParallelGrid, ProcessTopology

__all__ = ["build_parallel_grid", "latest_grid"]

_latest = None  # the grid the latest initialize() used, for DeepSpeed's `utils.groups` getters


def latest_grid():
    """The grid (`mpu`) the latest `initialize` built or was given; None without one."""
    return _latest


def build_parallel_grid(config, mpu):
    """The grid the engine takes as its `mpu`: the user's `mpu` if given, else one built from the config."""
    global _latest
    _latest = _grid(config.sequence_parallel_size, mpu)
    return _latest


def _grid(sp: int, mpu):
    if sp == 1:
        return mpu
    if mpu is not None:
        if getattr(mpu, "get_sequence_parallel_world_size", lambda: 1)() != sp:
            raise ValueError(
                f"sequence_parallel_size is {sp} but the mpu passed to initialize has no sequence-parallel "
                "groups of that size; pass no mpu (the grid is built from the config) or a matching one"
            )
        return mpu
    world = dist.get_world_size()
    if world % sp != 0:
        raise ValueError(f"sequence_parallel_size ({sp}) does not divide the world size ({world})")
    return ParallelGrid(ProcessTopology(axes=["data", "sequence"], dims=[world // sp, sp]))
