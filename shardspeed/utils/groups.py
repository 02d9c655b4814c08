"""DeepSpeed's `deepspeed.utils.groups` getters for the process groups of each parallel axis.

Integrations (Accelerate, Transformers) and user code ask this module for the data- and sequence-parallel
groups. The answers come from the grid the latest `initialize` built or was given as `mpu`
(`runtime.layout.latest_grid`); no group is held here. Without a grid, data parallelism spans the world and
every other axis has size 1 and position 0, which is what DeepSpeed answers when that axis is not configured.
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
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]


def _ask(method: str, default):
    """`latest_grid().<method>()` when the grid has that method, else `default()`."""
    grid = latest_grid()
    if grid is not None and hasattr(grid, method):
        return getattr(grid, method)()
    return default()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _get_data_parallel_group():
    return _ask("get_data_parallel_group", lambda: dist.group.WORLD)


def _get_data_parallel_world_size() -> int:
    return _ask("get_data_parallel_world_size", _world_size)


def _get_data_parallel_rank() -> int:
    return _ask("get_data_parallel_rank", _rank)


def _get_model_parallel_world_size() -> int:
    return _ask("get_model_parallel_world_size", lambda: 1)


def _get_model_parallel_rank() -> int:
    return _ask("get_model_parallel_rank", lambda: 0)


def _get_sequence_parallel_group():
    if _get_sequence_parallel_world_size() == 1:
        return None  # no sequence parallelism configured (a pipeline grid, say, has no sequence axis)
    return _ask("get_sequence_parallel_group", lambda: None)


def _get_sequence_parallel_world_size() -> int:
    return _ask("get_sequence_parallel_world_size", lambda: 1)


def _get_sequence_parallel_rank() -> int:
    return _ask("get_sequence_parallel_rank", lambda: 0)


def _get_sequence_data_parallel_group():
    return _ask("get_sequence_data_parallel_group", _get_data_parallel_group)


def _get_sequence_data_parallel_world_size() -> int:
    return _ask("get_sequence_data_parallel_world_size", _get_data_parallel_world_size)


def _get_sequence_data_parallel_rank() -> int:
    return _ask("get_sequence_data_parallel_rank", _get_data_parallel_rank)
