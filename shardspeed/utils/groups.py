"""DeepSpeed's `deepspeed.utils.groups` getters for the process groups of each parallel axis.

Integrations (Accelerate, Transformers) ask this module for the data-, tensor- and sequence-parallel
groups. The answers come from the grid (or the user's mpu) the latest `initialize` ran with
(`runtime.layout.latest_grid`); with none, every axis but data has size 1 and position 0, which is what
DeepSpeed answers when that axis is not configured. No process group is held here.
"""

from __future__ import annotations

import torch.distributed as dist

from shardspeed.runtime.layout import latest_grid

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_model_parallel_rank",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
]


def _ask(getter: str, default):
    grid = latest_grid()
    if grid is not None and hasattr(grid, getter):
        return getattr(grid, getter)()
    return default() if callable(default) else default


def _get_data_parallel_group():
    return _ask("get_data_parallel_group", lambda: dist.group.WORLD)


def _get_data_parallel_world_size() -> int:
    return _ask("get_data_parallel_world_size", lambda: dist.get_world_size() if dist.is_initialized() else 1)


def _get_data_parallel_rank() -> int:
    return _ask("get_data_parallel_rank", lambda: dist.get_rank() if dist.is_initialized() else 0)


def get_tensor_model_parallel_group():
    return _ask("get_tensor_model_parallel_group", None)


def get_tensor_model_parallel_world_size() -> int:
    return _ask("get_tensor_model_parallel_world_size", 1)


def get_tensor_model_parallel_rank() -> int:
    return _ask("get_tensor_model_parallel_rank", 0)


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor rank 0 in this rank's tensor group."""
    group = get_tensor_model_parallel_group()
    if group is None:
        return dist.get_rank() if dist.is_initialized() else 0
    return dist.get_global_rank(group, 0)


# DeepSpeed's AutoTP getters answer "model parallel" with the tensor group
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
_get_model_parallel_world_size = get_tensor_model_parallel_world_size
_get_model_parallel_rank = get_tensor_model_parallel_rank
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


def _get_sequence_parallel_group():
    return None  # no sequence parallelism: Accelerate only asks when sp_size > 1, which initialize refuses


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_data_parallel_group():
    return _get_data_parallel_group()
