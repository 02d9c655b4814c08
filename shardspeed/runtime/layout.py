"""The parallel layout `initialize` builds from the config: one `ParallelGrid` the engine takes as its mpu.

With `tensor_parallel.autotp_size` = t > 1 the world of W ranks becomes a (data, model) grid of W/t
replicas x t tensor ranks, tensor ranks neighbours (rank = data * t + model), so the engine reduces
gradients and shards ZeRO state over the data axis only.

With `sequence_parallel_size` = s > 1 it becomes a (data, sequence) grid with the sequence axis varying
fastest, so a sequence group is consecutive ranks, as in DeepSpeed (world 4, sp 2: sequence groups [0, 1]
and [2, 3], data groups [0, 2] and [1, 3]); the engine reduces over the sequence x data ranks.

The two together are not supported yet. The grid the latest `initialize` built (or the user's mpu) is kept
here for `deepspeed.utils.groups`' getters (`latest_grid`); nothing else reads it.

`tp_model_init` (DeepSpeed 0.19.8's `deepspeed.tp_model_init`) only records its arguments on the model, as
in DeepSpeed; `merge_tp_model_init` merges them into the config's `tensor_parallel` block at `initialize`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm.topology import ParallelGrid, ProcessTopology
from shardspeed.config import ConfigError

__all__ = [
    "build_parallel_grid",
    "data_parallel_world",
    "latest_grid",
    "merge_tp_model_init",
    "tp_model_init",
]

_LATEST: dict[str, object] = {"grid": None}


def latest_grid():
    """The grid (or user mpu) the latest `initialize` ran with; None before any."""
    return _LATEST["grid"]


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """Record `tp_size` (and `dtype`, `config`) for `initialize`, which does the sharding. Returns `model`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tp_model_init: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if kwargs.get("tp_group") is not None:
        raise ValueError(
            "tp_model_init(tp_group=...): pass the layout through the config's tensor_parallel block"
        )
    model._shardspeed_tp_model_init = {"tp_size": tp_size, "dtype": dtype, "config": config}
    return model


def merge_tp_model_init(raw: dict, model):
    """The config dict with `tp_model_init`'s recorded arguments merged into `tensor_parallel`, and the
    tensor degree. The dict is returned untouched when neither asks for tensor parallelism."""
    from shardspeed.pipe.module import PipelineModule

    recorded = getattr(model, "_shardspeed_tp_model_init", None)
    block = raw.get("tensor_parallel") if isinstance(raw, dict) else None
    size = block.get("autotp_size", 0) if isinstance(block, dict) else 0
    if recorded is None:
        size = size if isinstance(size, int) and size > 1 else 1
        if size > 1 and isinstance(model, PipelineModule):
            raise ConfigError(
                "tensor_parallel.autotp_size: AutoTP cannot be combined with a PipelineModule yet"
            )
        return raw, size
    if size not in (0, 1, recorded["tp_size"]):
        raise ConfigError(
            f"tensor_parallel.autotp_size: {size} conflicts with tp_model_init(tp_size={recorded['tp_size']})"
        )
    merged = dict(raw)
    merged["tensor_parallel"] = {**(block or {}), "autotp_size": recorded["tp_size"]}
    return merged, max(1, recorded["tp_size"])


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
