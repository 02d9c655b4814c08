"""Flat parameter buckets: the unit ZeRO partitions.

A bucket's parameters are packed, in order, into one flat buffer padded to a multiple of the world size;
each parameter's `.data` becomes a view into it. Rank r owns the contiguous slice
`[r * shard_numel, (r + 1) * shard_numel)` — its *shard* — for optimizer state (stage 1), gradients
(stage 2) and, in stage 3, the parameter values themselves. Because gradient buckets use the same layout,
a bucket's reduce-scatter and all-gather run in place on flat buffers with no packing copies.
"""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.core.partitioned import full_value, is_partitioned, logical_numel, logical_shape


class FlatParamBucket:
    """Parameters of one optimizer group packed into a padded flat buffer, split into per-rank shards."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group_index: int, world: int, rank: int):
        self.params = params
        self.names = names
        self.group_index = group_index
        # Parameters built under zero.Init arrive as 1/N chunks: use their logical sizes and full values.
        self.numels = [logical_numel(p) for p in params]
        self.shapes = [logical_shape(p) for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world)
        self.world, self.rank = world, rank
        self.padded_numel = self.shard_numel * world
        self.dtype, self.device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        for p, offset, n in zip(params, self.offsets, self.numels):
            self.flat[offset : offset + n].copy_(full_value(p).reshape(-1))
            if is_partitioned(p):
                del p._zero_init_shard, p._zero_init_shape, p._zero_init_group
        self.bind()

    def bind(self) -> None:
        """Point every parameter's `.data` at its slice of the flat buffer."""
        for p, offset, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = self.flat[offset : offset + n].view(shape)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice of the flat buffer (a view: writing it updates the module's parameters)."""
        return self.flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    def replace_shard(self, value: torch.Tensor) -> None:
        """Overwrite this rank's shard with `value` (the optimizer's updated master). A master on the host
        crosses as fp32 from page-locked memory (asynchronous: the next bucket steps meanwhile) and is
        converted on the device — torch would convert a cross-device copy on the host, synchronously. The
        all-gather that publishes the shard is queued after it on the same stream."""
        shard = self.shard
        if value is shard:
            return
        if value.device != shard.device:
            value = value.to(shard.device, non_blocking=True)
        shard.copy_(value)

    def move_to(self, device: torch.device, pin_memory: bool = False, non_blocking: bool = False) -> None:
        """Move the flat buffer (the module's parameters) to `device` and re-point the parameters at it
        (`engine.offload_states`)."""
        self.flat = _moved(self.flat, device, pin_memory, non_blocking)
        self.device = self.flat.device
        self.bind()

    def fragments(self, rank: int | None = None):
        """For each parameter, the part of it inside `rank`'s shard: (index, name, start in param, start in
        shard, length). Parameters outside the shard are skipped."""
        rank = self.rank if rank is None else rank
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        for i, (name, offset, n) in enumerate(zip(self.names, self.offsets, self.numels)):
            start, end = max(lo, offset), min(hi, offset + n)
            if start < end:
                yield i, name, start - offset, start - lo, end - start

    def layout(self) -> dict:
        """What a checkpoint needs to find every parameter inside the shards."""
        return {
            "group": self.group_index,
            "names": list(self.names),
            "shapes": list(self.shapes),
            "offsets": list(self.offsets),
            "numel": self.numel,
            "shard_numel": self.shard_numel,
        }


def _moved(tensor: torch.Tensor, device: torch.device, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    """`tensor` on `device` (itself if already there); page-locked when moved to the host with `pin_memory`."""
    if tensor.device == torch.device(device):
        return tensor
    if pin_memory and torch.device(device).type == "cpu" and torch.cuda.is_available():
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=non_blocking)
    return tensor.to(device, non_blocking=non_blocking)
