"""The parallel layout `initialize` builds from the config: one `ParallelGrid` the engine takes as its mpu.

With `tensor_parallel.autotp_size` = t > 1 the world of W ranks becomes a (data, model) grid of W/t
replicas x t tensor ranks, tensor ranks neighbours (rank = data * t + model), so the engine reduces
gradients and shards ZeRO state over the data axis only.

With `sequence_parallel_size` = s > 1 it becomes a (data, sequence) grid with the sequence axis varying
fastest, so a sequence group is consecutive ranks, as in DeepSpeed (world 4, sp 2: sequence groups [0, 1]
and [2, 3], data groups [0, 2] and [1, 3]); the engine reduces over the sequence x data ranks.

The two together are not supported yet. The grid the latest `initialize` built (or the user's mpu) is kept
here for `deepspeed.utils.groups`' getters (`latest_grid`); nothing else reads it.
"""

from __future__ import annotations

import torch.distributed as dist

from shardspeed.comm.topology import ParallelGrid, ProcessTopology
from shardspeed.config import ConfigError

__all__ = [
    "build_parallel_grid",
    "data_parallel_world",
    "latest_grid",
]

_LATEST: dict[str, object] = {"grid": None}


def latest_grid():
    """The grid (or user mpu) the latest `initialize` ran with; None before any."""
    return _LATEST["grid"]


def data_parallel_world(world: int, tp_size: int) -> int:
    """Data-parallel replicas of a `world`-rank job at tensor degree `tp_size` (which must divide it)."""
    if world % tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size: {tp_size} does not divide the world size {world}")
    return world // tp_size


def build_parallel_grid(config, mpu):
    """The mpu the engine runs with: the user's, or a grid built from the config when it asks for tensor or
    sequence parallelism (collective: every rank calls it)."""
    tp, sp = config.tensor_parallel.size, config.sequence_parallel_size
    if tp > 1 and sp > 1:
        raise ConfigError(
            f"tensor_parallel.autotp_size ({tp}) together with sequence_parallel_size ({sp}) is not supported "
            "yet; use one of them"
        )
    if tp > 1:
        mpu = _tensor_grid(tp, mpu)
    elif sp > 1:
        mpu = _sequence_grid(sp, mpu)
    _LATEST["grid"] = mpu
    return mpu


def _tensor_grid(tp: int, mpu):
    if mpu is not None:
        have = mpu.get_tensor_model_parallel_world_size() if hasattr(mpu, "get_tensor_model_parallel_world_size") \
            else mpu.get_model_parallel_world_size()  # fmt: skip
        if have != tp:
            raise ConfigError(f"tensor_parallel.autotp_size: {tp} but the mpu passed to initialize has {have} "
                              "tensor-parallel ranks")  # fmt: skip
        return mpu
    world = dist.get_world_size()
    return ParallelGrid(ProcessTopology(["data", "model"], [data_parallel_world(world, tp), tp]))


def _sequence_grid(sp: int, mpu):
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


def tensor_group(mpu):
    """The tensor-parallel group of a grid or Megatron-style mpu."""
    for getter in ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group"):
        if hasattr(mpu, getter):
            return getattr(mpu, getter)()
    raise ValueError(f"the mpu {type(mpu).__name__} has no tensor-parallel group getter")
