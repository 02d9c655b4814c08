"""Where a checkpointed block's inputs wait for the recomputation: as they are, in host memory
(`cpu_checkpointing`), split across the model-parallel group (`partition_activations`), or copied into
preallocated slots (`contiguous_memory_optimization`).

`store(tensor)` returns a `StoredTensor`; its `restore()` gives back a tensor equal to the original on the
original device, and `release()` returns any slot it used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_flat

__all__ = ["ContiguousSlots", "StoredTensor", "store"]


class StoredTensor:
    """One saved input: `data` is what is kept (the tensor, a host copy, or this rank's slice)."""

    def __init__(self, data, *, shape, device, dtype, group=None, slot=None, slots=None):
        self.data, self.shape, self.device, self.dtype = data, shape, device, dtype
        self.group, self.slot, self.slots = group, slot, slots

    def restore(self) -> torch.Tensor:
        data = self.data
        if self.group is not None:
            world = dist.get_world_size(self.group)
            full = torch.empty(data.numel() * world, dtype=data.dtype, device=self.device)
            all_gather_flat(full, data.to(self.device), group=self.group)
            data = full
        numel = 1
        for d in self.shape:
            numel *= d
        return data.reshape(-1)[:numel].view(self.shape).to(self.device, non_blocking=True)

    def release(self) -> None:
        if self.slots is not None and self.slot is not None:
            self.slots.free(self.slot)
            self.slot = None


class ContiguousSlots:
    """`number_checkpoints` reusable flat buffers, one per checkpointed block alive at a time.

    Allocating every saved input anew fragments a GPU allocator when activations are large; these buffers
    are allocated once (grown only if a later input is bigger) and reused across steps until `reset()`.
    """

    def __init__(self, number_checkpoints: int | None):
        self.limit = number_checkpoints
        self.buffers: list[torch.Tensor] = []
        self.in_use: set[int] = set()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[int, torch.Tensor]:
        free = [i for i in range(len(self.buffers)) if i not in self.in_use]
        if free:
            index = free[0]
        elif self.limit is None or len(self.buffers) < self.limit:
            index = len(self.buffers)
            self.buffers.append(torch.empty(0, dtype=dtype, device=device))
        else:
            raise RuntimeError(
                f"activation_checkpointing.number_checkpoints is {self.limit} but more checkpointed blocks "
                "are alive at once; raise it to the number of checkpoint() calls in one forward pass"
            )
        buffer = self.buffers[index]
        if buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self.buffers[index] = torch.empty(numel, dtype=dtype, device=device)
        self.in_use.add(index)
        return index, buffer[:numel]

    def free(self, index: int) -> None:
        self.in_use.discard(index)

    def reset(self) -> None:
        self.buffers, self.in_use = [], set()


def store(tensor: torch.Tensor, *, cpu: bool, group, slots: ContiguousSlots | None) -> StoredTensor:
    """Keep `tensor` (already detached) for the recomputation, per the configured options."""
    device, shape, dtype = tensor.device, tuple(tensor.shape), tensor.dtype
    data = tensor
    if group is not None and dist.get_world_size(group) > 1 and tensor.is_floating_point():
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        per_rank = -(-tensor.numel() // world)
        flat = torch.zeros(per_rank * world, dtype=dtype, device=device)
        flat[: tensor.numel()] = tensor.reshape(-1)
        data = flat[rank * per_rank : (rank + 1) * per_rank].clone()
    else:
        group = None
    slot = None
    if slots is not None and data.is_floating_point():
        slot, buffer = slots.take(data.numel(), dtype, device)
        buffer.copy_(data.reshape(-1))
        data = buffer
    if cpu and data.device.type != "cpu":
        host = torch.empty(data.shape, dtype=dtype, pin_memory=True)
        host.copy_(data, non_blocking=True)
        data = host
        if slot is not None:  # the host copy is what is kept; the device slot is free again
            slots.free(slot)
            slot = None
    return StoredTensor(data, shape=shape, device=device, dtype=dtype, group=group, slot=slot, slots=slots)
