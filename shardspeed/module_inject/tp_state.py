"""Whole tensors from tensor-parallel shards: gather one, gather a state dict, re-split a full state dict.

Sharded parameters carry their `TPPartition` (layers.py); everything else is replicated over the tensor
group and read as is. Gathers are collective over the tensor group (every tensor rank calls, in the same
parameter order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.module_inject.layers import TPPartition, gather_shards, shard_tensor

__all__ = ["gather_full", "partitions_of", "reshard_state_dict", "tp_full_state_dict"]


def partitions_of(module: nn.Module) -> dict[str, TPPartition]:
    """State-dict name -> partition of every sharded parameter (tied names included)."""
    return {
        name: p.tp_partition
        for name, p in module.named_parameters(remove_duplicate=False)
        if getattr(p, "tp_partition", None) is not None
    }


def gather_full(tensor: torch.Tensor, part: TPPartition, group) -> torch.Tensor:
    """The whole tensor from every tensor rank's shard (collective over `group`)."""
    shards = [torch.empty_like(tensor) for _ in range(part.tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return gather_shards(shards, part)


def tp_full_state_dict(module: nn.Module, group, state: dict | None = None) -> dict[str, torch.Tensor]:
    """`module.state_dict()` (or `state`) with every sharded entry gathered whole."""
    parts = partitions_of(module)
    state = module.state_dict() if state is None else state
    return {k: gather_full(v, parts[k], group) if k in parts else v for k, v in state.items()}


def reshard_state_dict(full: dict, parts: dict[str, TPPartition], rank: int) -> dict:
    """This rank's shards of a full state dict (entries without a partition are kept whole)."""
    return {k: shard_tensor(v, parts[k], rank).clone() if k in parts else v for k, v in full.items()}
