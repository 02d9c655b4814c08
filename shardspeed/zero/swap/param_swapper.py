"""`offload_param` (stage 3): where a parameter unit's shard lives between uses — host memory or a file.

A `ParamTier` is the offload target shared by every unit; each non-persistent unit's shard gets an
`OffloadedShard` home in it:

- "cpu": the shard is a host tensor (page-locked with `pin_memory` on CUDA); a gather copies it to the device
  first. On a CPU-only run the host *is* the device, so nothing moves.
- "nvme": the first `max_in_cpu` elements of shards are kept in host memory as with "cpu"; every other shard
  is a file under `nvme_path`, read into a page-aligned buffer when the unit is gathered and dropped when it
  is released. The coordinator reads ahead of the recorded order (`prefetch`), keeping at most
  `buffer_count * buffer_size` elements of shards in memory (in flight or waiting to be gathered), so the
  reads overlap the compute of the units before them.

A unit writes its shard back to its home only when something outside the gather path may have changed it
(the optimizer step, a checkpoint load, `GatheredParameters` with a modifier rank): see ParamUnit.shard.
The optimizer step overwrites whole shards, so it replaces them in their homes without reading them first
(`ParamUnit.replace_shard`).
Gradients never come here: the reducer hands each gradient shard straight to the optimizer side.
"""

from __future__ import annotations

import torch

from shardspeed.zero.swap.aio import AsyncFileIO, IoRequest, aligned_empty
from shardspeed.zero.swap.folder import SwapFolder

__all__ = ["OffloadedShard", "ParamTier", "build_param_tier"]

PARAM_KEY = "zero_optimization.offload_param.nvme_path"


class ParamTier:
    """The parameter offload target: device ("cpu" or "nvme"), its folder and I/O, and the buffer budget."""

    def __init__(self, device: str, *, nvme_path: str | None = None, rank: int = 0, bytes_needed: int = 0,
                 pin_memory: bool = False, buffer_count: int = 5, buffer_size: int = 100_000_000,
                 max_in_cpu: int = 1_000_000_000, aio=None):  # fmt: skip
        self.device = device
        self.pin = pin_memory
        self.prefetch_budget = max(0, buffer_count) * buffer_size  # elements of shards read ahead at most
        self.cpu_budget = max_in_cpu if device == "nvme" else None
        self.buffered_numel = 0  # elements of NVMe shards in memory now (read ahead or in use)
        self.max_writes = max(1, buffer_count)
        self._writing: list[OffloadedShard] = []  # shards whose write is in flight, oldest first
        self.folder = self.io = None
        if device == "nvme":
            self.folder = SwapFolder(nvme_path, "param", rank, bytes_needed, PARAM_KEY)
            self.io = AsyncFileIO(aio)

    def home_for(self, shard: torch.Tensor, name: str) -> OffloadedShard:
        """A home for a unit's shard (stored there now); host memory while `max_in_cpu` allows."""
        on_disk = self.device == "nvme" and shard.numel() > self.cpu_budget
        if self.device == "nvme" and not on_disk:
            self.cpu_budget -= shard.numel()
        return OffloadedShard(self, shard, name, on_disk)

    def track_write(self, shard: OffloadedShard) -> None:
        """Note a write in flight; finished ones are reaped (their source buffers freed) and at most
        `buffer_count` are left in flight."""
        self._writing.append(shard)
        still = []
        for pending in self._writing:
            if pending._write is not None and pending._write.done():
                pending._finish_write()
            if pending._write is not None:
                still.append(pending)
        while len(still) > self.max_writes:
            still.pop(0)._finish_write()
        self._writing = still

    def disk_bytes(self) -> int:
        return self.folder.disk_bytes() if self.folder is not None else 0

    def close(self) -> None:
        for pending in self._writing:
            pending._finish_write()
        self._writing = []
        if self.io is not None:
            self.io.close()
            self.folder.close()


class OffloadedShard:
    """One unit's shard in its home; `load()` gives it on the compute device."""

    def __init__(self, tier: ParamTier, value: torch.Tensor, name: str, on_disk: bool):
        self.tier, self.device, self.dtype, self.numel = tier, value.device, value.dtype, value.numel()
        self.file = tier.folder.file(f"{name}.shard") if on_disk else None
        self.host: torch.Tensor | None = None  # host tier: the value; NVMe: a read buffer while loaded
        self._read: IoRequest | None = None
        self._write: IoRequest | None = None
        if self.file is None:
            self.host = aligned_empty(self.numel, self.dtype, pin=tier.pin)
        self.store(value)

    @property
    def on_disk(self) -> bool:
        return self.file is not None

    def store(self, value: torch.Tensor) -> None:
        """Make `value` the shard's home copy (a file write is left in flight; a read waits for it)."""
        if not self.on_disk:
            if value.data_ptr() != self.host.data_ptr():
                self.host.copy_(value)
            return
        self._finish_write()
        source = value if value.device.type == "cpu" else value.to("cpu")
        self._write = self.tier.io.write(source.contiguous(), self.file)
        self.tier.track_write(self)

    def replace(self, value: torch.Tensor) -> None:
        """Make `value` (any dtype or device) the home copy without reading the old one: the optimizer step
        overwrites the whole shard, so reading it first would only cost a read per parameter per step."""
        if not self.on_disk:
            self.host.copy_(value)  # no-op when `value` is the host copy itself (a CPU-only fp32 run)
            return
        self.drop()  # a buffer read ahead holds the old value
        buffer = aligned_empty(self.numel, self.dtype, pin=self.tier.pin)
        buffer.copy_(value)
        self.store(buffer)

    def prefetch(self) -> bool:
        """Start reading the shard if the read-ahead budget allows; True when it is (being) read."""
        if not self.on_disk or self.host is not None:
            return True
        if self.tier.buffered_numel + self.numel > self.tier.prefetch_budget:
            return False
        self._start_read()
        return True

    def load(self) -> torch.Tensor:
        """The shard's value on the compute device (waits for a read in flight, or reads now)."""
        if self.on_disk:
            if self.host is None:
                self._start_read()
            self._read.wait()
        if self.host.device == self.device:
            return self.host
        return self.host.to(self.device, non_blocking=True)

    def drop(self) -> None:
        """Release an NVMe shard's buffer (the file holds the value)."""
        if self.on_disk and self.host is not None:
            if self._read is not None:
                self._read.wait()
            self.host, self._read = None, None
            self.tier.buffered_numel -= self.numel

    def _start_read(self) -> None:
        self._finish_write()
        self.host = aligned_empty(self.numel, self.dtype, pin=self.tier.pin)
        self.tier.buffered_numel += self.numel
        self._read = self.tier.io.read(self.host, self.file)

    def _finish_write(self) -> None:
        if self._write is not None:
            self._write.wait()
            self._write = None


def build_param_tier(block, aio, module, group) -> ParamTier | None:
    """The tier `zero_optimization.offload_param` asks for (None when off). The NVMe folder is checked for
    room for this rank's share of every parameter (its 1/N shards, in their dtype)."""
    if block is None or block.device == "none":
        return None
    import torch.distributed as dist

    from shardspeed.core.partitioned import logical_numel

    world = dist.get_world_size(group)
    bytes_needed = sum(-(-logical_numel(p) // world) * p.element_size() for p in module.parameters())
    return ParamTier(
        block.device, nvme_path=block.nvme_path, rank=dist.get_rank(group), bytes_needed=bytes_needed,
        pin_memory=block.pin_memory, buffer_count=block.buffer_count, buffer_size=block.buffer_size,
        max_in_cpu=block.max_in_cpu, aio=aio,
    )  # fmt: skip
