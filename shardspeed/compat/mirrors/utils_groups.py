"""DeepSpeed's `deepspeed.utils.groups` getters for the process groups of each parallel axis.

Integrations (Accelerate, Transformers) and user code ask this module for the data-, tensor- and
sequence-parallel groups. The answers come from the grid (or the user's mpu) the latest `initialize` ran
with (`runtime.layout.latest_grid`); with none, data parallelism spans the world and every other axis has
size 1 and position 0, which is what DeepSpeed answers when that axis is not configured. No process group
is held here. The expert getters (`group_name` is "ep_size_<n>") answer from the expert groups the latest
`initialize` built (shardspeed/moe/groups.py).
"""

from __future__ import annotations

import torch.distributed as dist

from shardspeed.core.layout import latest_grid

__all__ = [
    "_create_expert_and_data_parallel",
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_world_size",
    "_get_max_expert_parallel_group",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
    "_get_model_parallel_rank",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
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


def _expert(group_name: str):
    from shardspeed.moe.groups import latest

    return latest()[group_name]


def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
):
    """Build the groups of one expert-parallel size over the world (collective)."""
    from shardspeed.moe.groups import build_expert_groups

    if use_data_before_expert_parallel_:
        raise NotImplementedError("use_data_before_expert_parallelism=True is not supported")
    build_expert_groups([expert_parallel_size_])


def _get_expert_parallel_group(group_name: str):
    return _expert(group_name).ep_group


def _get_expert_data_parallel_group(group_name: str):
    return _expert(group_name).edp_group


def _get_expert_parallel_group_dict() -> dict:
    from shardspeed.moe.groups import latest

    return {name: g.ep_group for name, g in latest().by_name.items()}


def _get_expert_data_parallel_group_dict() -> dict:
    from shardspeed.moe.groups import latest

    return {name: g.edp_group for name, g in latest().by_name.items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert(group_name).ep_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert(group_name).ep_rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert(group_name).edp_size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert(group_name).edp_rank


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank expert-data-parallel replicas of this rank's experts start from."""
    return _expert(group_name).edp_ranks[0]


def _get_max_expert_size() -> int:
    from shardspeed.moe.groups import latest

    return max((g.ep_size for g in latest().by_name.values()), default=1)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    """The expert-parallel group of the largest expert-parallel size built (where an overflow in any expert
    must be agreed on)."""
    return _get_expert_parallel_group(_get_max_expert_size_name())
