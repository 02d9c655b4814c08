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

from shardspeed.comm import ops
from shardspeed.comm.discovery import ProcessInfo, discover
from shardspeed.comm.init import init_distributed
from shardspeed.comm.logger import configure, log_summary
from shardspeed.comm.ops import *  # noqa: F403  (the collectives: ops.__all__ is their one list)


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


# The facade's names: what this module adds, and the collectives of ops.py (listed there once).
__all__ = [
    "ProcessInfo",
    "ReduceOp",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "discover",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "log_summary",
    "monitored_barrier",
    "new_group",
]
__all__ += ops.__all__
__all__.sort()
