"""Partitioned parameters: the state a ZeRO-3 parameter carries, and the helpers that read or restore it.

A parameter built under `zero.Init` (zero/init.py) keeps only this rank's chunk (`_zero_init_shard`, with
its logical shape and process group) and DeepSpeed's `ds_*` attributes, which outside code reads to detect
ZeRO-3 parameters. Everything that must see through a chunk to the model's shapes (gradient buckets, flat
parameter buffers, ZeRO-3 units, the FLOPs profiler) asks here, below the ZeRO package, so the low training
parts do not depend on ZeRO itself.
"""

from __future__ import annotations

import enum
import itertools

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_flat

__all__ = [
    "ZeroParamStatus",
    "ZeroParamType",
    "full_value",
    "gather",
    "is_partitioned",
    "logical_numel",
    "logical_shape",
    "mark_zero_param",
    "materialize",
    "release",
    "unmark_zero_param",
]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's `ds_status` of a ZeRO-3 parameter."""

    AVAILABLE = 1  # the full value is present
    NOT_AVAILABLE = 2  # only this rank's partition exists
    INFLIGHT = 3  # being gathered


class ZeroParamType(enum.Enum):
    """DeepSpeed's kinds of ZeRO parameter."""

    NORMAL = 1  # a plain parameter
    PARTITIONED = 2  # split across the data-parallel ranks
    REMOTE = 3  # held by one rank


_ds_ids = itertools.count()  # DeepSpeed numbers ZeRO-3 parameters in creation order, process-wide
_DS_ATTRIBUTES = ("ds_id", "ds_status", "ds_shape", "ds_numel", "ds_tensor", "ds_persist", "ds_process_group",
                  "ds_active_sub_modules")  # fmt: skip


def mark_zero_param(param: torch.Tensor, shape, group, status: ZeroParamStatus, tensor=None,
                    persist: bool = False) -> None:  # fmt: skip
    """Give `param` DeepSpeed's ZeRO-3 attributes (keeping its `ds_id` if it has one)."""
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_ds_ids)
    param.ds_shape = torch.Size(shape)
    param.ds_numel = param.ds_shape.numel()
    param.ds_status, param.ds_tensor, param.ds_persist = status, tensor, persist
    param.ds_process_group = group
    param.ds_active_sub_modules = set()


def unmark_zero_param(param: torch.Tensor) -> None:
    """A parameter that is whole again (stages 0-2) sheds the ZeRO-3 attributes."""
    for name in _DS_ATTRIBUTES:
        if hasattr(param, name):
            delattr(param, name)


def is_partitioned(param: torch.Tensor) -> bool:
    return getattr(param, "_zero_init_shard", None) is not None


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape a parameter has for the model (also while only its chunk exists)."""
    return tuple(param._zero_init_shape) if is_partitioned(param) else tuple(param.shape)


def logical_numel(param: torch.Tensor) -> int:
    numel = 1
    for d in logical_shape(param):
        numel *= d
    return numel


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The parameter's full value (an all-gather of the chunks if it is partitioned; collective)."""
    if not is_partitioned(param):
        return param.detach()
    shard, group = param._zero_init_shard.to(param.device), param._zero_init_group  # from a remote tier
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype, device=shard.device)
    all_gather_flat(full, shard, group=group)
    return full[: logical_numel(param)].view(logical_shape(param)).to(param.dtype)


def materialize(param: torch.Tensor) -> None:
    """Give a partitioned parameter its full value back (collective)."""
    if is_partitioned(param):
        param.data = full_value(param).clone()
        del param._zero_init_shard, param._zero_init_shape, param._zero_init_group
        unmark_zero_param(param)


def gather(param: torch.Tensor) -> None:
    """Give a partitioned parameter its full value for a while, keeping its chunk (collective)."""
    param.data = full_value(param).clone()
    param.ds_status = ZeroParamStatus.AVAILABLE


def release(param: torch.Tensor, modifier_rank: int | None) -> None:
    """End `gather`: with `modifier_rank`, that rank's full value becomes everyone's chunk (collective);
    without, changes are dropped. The parameter is empty again afterwards."""
    shard, group = param._zero_init_shard, param._zero_init_group
    if modifier_rank is not None:
        full = param.data.contiguous()
        src = dist.get_global_rank(group, modifier_rank) if group is not None else modifier_rank
        dist.broadcast(full, src=src, group=group)
        mine = full.reshape(-1)[dist.get_rank(group) * shard.numel() :][: shard.numel()]
        shard.zero_()[: mine.numel()].copy_(mine)
    param.data = torch.empty(0, dtype=shard.dtype, device=shard.device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
