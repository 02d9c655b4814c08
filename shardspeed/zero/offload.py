"""Optimizer offload (`zero_optimization.offload_optimizer`): where fp32 masters and optimizer state live.

- device "cpu": the fp32 master shards and the optimizer state are CPU tensors (masters page-locked with
  `pin_memory` when CUDA is present, or by the native backend, DS_PIN_MEMORY_BACKEND=native), the optimizer steps on the CPU, gradient shards are copied down
  before the step and updated shards copied back after it. In a CPU-only run that is where everything
  already lives, so nothing moves.
- device "nvme": as "cpu", and between steps the fp32 masters and every per-element state tensor (Adam's
  two moments) are in files under `nvme_path`; the step streams them through memory one sub-group at a
  time (zero/swap/optimizer_swapper.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.zero.swap.aio import AioSettings


@dataclass
class OptimizerOffload:
    """What the engine asked for: the device ("cpu" or "nvme"), the swap folder, pinning, and for NVMe the
    pipelining of the sub-group swaps and the `aio` settings."""

    device: str
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    aio: AioSettings = field(default_factory=AioSettings)

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    _pinned: list = field(default_factory=list, repr=False)  # masters the accelerator page-locked

    def place_master(self, shard: torch.Tensor) -> torch.Tensor:
        """A fp32 CPU copy of a shard, page-locked when asked and possible: through the accelerator, which
        pins with torch on CUDA (nothing on a CPU-only build) or with mlock when DS_PIN_MEMORY_BACKEND=native."""
        master = shard.detach().to(device=self.host, dtype=torch.float32, copy=True)
        if not self.pin_memory:
            return master
        pinned = get_accelerator().pin_memory(master)
        if pinned is not master:
            self._pinned.append(pinned)
        return pinned

    def close(self) -> None:
        """Unlock what the native backend locked (engine.destroy()); the masters stay usable, pageable."""
        for master in self._pinned:
            get_accelerator().unpin_memory(master)
        self._pinned.clear()


class GradientNorms:
    """Squared norms of the reduced gradient shards, taken as each arrives in the boundary backward, so the
    step only sums a few numbers. On their own (NVMe optimizer offload) they are all the optimizer keeps of
    the gradients in memory: the shards themselves are in the swap files."""

    def __init__(self, count: int, device: torch.device):
        self.device = device
        self._squared_norms: list[torch.Tensor | None] = [None] * count

    def receive(self, index: int, shard: torch.Tensor) -> None:
        self._squared_norms[index] = torch.linalg.vector_norm(shard, dtype=torch.float32) ** 2

    def squared_norm(self) -> torch.Tensor:
        """Sum of the received shards' squared norms (a 0-d tensor on the device the shards came from)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for value in self._squared_norms:
            if value is not None:
                total += value.to(self.device)
        return total

    def clear(self) -> None:
        self._squared_norms = [None] * len(self._squared_norms)


class HostGradients(GradientNorms):
    """fp32 host copies of the reduced gradient shards, the optimizer-side inputs of an offloaded step.

    Each shard is copied as soon as its reduction completes in the boundary backward (stages 2/3: bucket by
    bucket, overlapping the rest of backward; stage 1: at the end of backward), into a reused buffer —
    page-locked on CUDA so the device-to-host copy is asynchronous — and its squared norm is taken then, so
    the step itself only waits for the copies and sums a few numbers. A shard already on the host (a CPU-only
    run) is used where it is, in its own dtype: no copy, and no fp32 copy of every gradient at once.
    """

    def __init__(self, numels: list[int], host: torch.device, device: torch.device):
        super().__init__(len(numels), device)
        pin = device.type == "cuda"
        # Untouched until a copy lands (a CPU-only fp32 run never copies): empty, not zeros.
        self._buffers = [torch.empty(n, dtype=torch.float32, device=host, pin_memory=pin) for n in numels]
        self.grads: list[torch.Tensor | None] = [None] * len(numels)

    def receive(self, index: int, shard: torch.Tensor) -> None:
        """Take bucket `index`'s final reduced gradient shard (call once per boundary backward)."""
        buffer = self._buffers[index]
        if shard.device == buffer.device:
            grad = shard  # already on the host: no copy (16-bit ones are up-cast one sub-group at a time)
        else:
            grad = buffer
            if shard.device != buffer.device and shard.dtype != buffer.dtype:
                # convert on the device first: torch converts a cross-device copy on the host, synchronously
                shard = shard.to(buffer.dtype)
            grad.copy_(shard, non_blocking=True)
        # Norm where the data is fastest to read: on the device for a GPU shard, on the fp32 host copy (no
        # up-cast temporary) for a CPU one.
        super().receive(index, shard if shard.device.type != "cpu" else grad)
        self.grads[index] = grad

    def take(self) -> list[torch.Tensor]:
        """The host gradients, once every asynchronous copy has landed; the next backward refills them."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        grads = [g if g is not None else torch.zeros_like(b) for g, b in zip(self.grads, self._buffers)]
        self.grads = [None] * len(grads)
        self.clear()
        return grads
