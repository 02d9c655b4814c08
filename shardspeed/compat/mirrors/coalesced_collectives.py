"""DeepSpeed's `reduce_scatter_coalesced`: average several tensors over a group, each rank keeping its part.

Each tensor is cut into world-size parts of ceil(numel / world) elements (the last ones shorter or empty);
the parts are laid out rank-major in one flat buffer (padded to equal size), so a single reduce-scatter
leaves every rank the average of its own part of every tensor. Used by code written against DeepSpeed's
ZeRO-3 internals and by its tests; shardspeed's own ZeRO reduces flat buckets (shardspeed/zero/).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import reduce_scatter_flat

__all__ = ["reduce_scatter_coalesced"]


def reduce_scatter_coalesced(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """This rank's part of the average over `group` of each tensor in `tensors` (one collective)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flats = [t.reshape(-1) for t in tensors]
    part_sizes = [math.ceil(f.numel() / world) for f in flats]
    per_rank = sum(part_sizes)
    buffer = torch.zeros(per_rank * world, dtype=tensors[0].dtype, device=tensors[0].device)
    for r in range(world):
        offset = r * per_rank
        for flat, size in zip(flats, part_sizes):
            piece = flat[r * size : (r + 1) * size]
            buffer[offset : offset + piece.numel()].copy_(piece)
            offset += size
    buffer.div_(world)  # divide first, as DeepSpeed does (keeps fp16 sums in range)
    mine = torch.empty(per_rank, dtype=buffer.dtype, device=buffer.device)
    reduce_scatter_flat(mine, buffer, group=group)
    outputs, offset = [], 0
    for flat, size in zip(flats, part_sizes):
        length = max(0, min(size, flat.numel() - rank * size))
        outputs.append(mine[offset : offset + length])
        offset += size
    return outputs
