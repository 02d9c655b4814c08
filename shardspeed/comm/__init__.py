"""`shardspeed.comm`: process-group start-up and a torch.distributed-like facade (as `deepspeed.comm`).

The collectives are torch.distributed's own (`ops.py` lets the comms logger see them, `logger.py`); this
module adds the DeepSpeed names users call.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed import (
    ReduceOp,
    broadcast_object_list,
    destroy_process_group,
    monitored_barrier,
    new_group,
)

from shardspeed.comm.discovery import ProcessInfo, discover
from shardspeed.comm.init import init_distributed
from shardspeed.comm.logger import configure, log_summary
from shardspeed.comm.ops import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def get_world_group():
    return dist.group.WORLD


__all__ = [
    "ProcessInfo",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "discover",
    "gather",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
