"""Optimizer offload (`zero_optimization.offload_optimizer`): where fp32 masters and optimizer state live.

- device "cpu": the fp32 master shards and the optimizer state are CPU tensors (page-locked with
  `pin_memory` when CUDA is present), the optimizer steps on the CPU, gradient shards are copied down
  before the step and updated shards copied back after it. In a CPU-only run that is where everything
  already lives, so nothing moves.
- device "nvme": as "cpu", and between steps every per-element state tensor (Adam's two moments: 8 of the
  16 bytes per parameter) is written to a file under `nvme_path` and dropped from memory. The step reads
  one bucket's state, steps that bucket, writes it back and drops it, so about one bucket's state is
  resident at a time. The fp32 masters stay in CPU memory (DeepSpeed swaps them too).
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from shardspeed.config import ConfigError
from shardspeed.runtime.placement import place_optimizer_state


@dataclass
class OptimizerOffload:
    """What the engine asked for: the device ("cpu" or "nvme"), the swap folder and pinning."""

    device: str
    nvme_path: str | None = None
    pin_memory: bool = False

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    def place_master(self, shard: torch.Tensor) -> torch.Tensor:
        """A fp32 CPU copy of a shard, page-locked when asked and possible."""
        master = shard.detach().to(device=self.host, dtype=torch.float32, copy=True)
        if self.pin_memory and torch.cuda.is_available():
            master = master.pin_memory()
        return master


class HostGradients:
    """fp32 host copies of the reduced gradient shards, the optimizer-side inputs of an offloaded step.

    Each shard is copied as soon as its reduction completes in the boundary backward (stages 2/3: bucket by
    bucket, overlapping the rest of backward; stage 1: at the end of backward), into a reused buffer —
    page-locked on CUDA so the device-to-host copy is asynchronous — and its squared norm is taken then, so
    the step itself only waits for the copies and sums a few numbers. A shard already on the host in fp32
    (a CPU-only fp32 run) is used where it is: no copy.
    """

    def __init__(self, masters: list[torch.Tensor], device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self._buffers = [torch.empty_like(m, pin_memory=pin) for m in masters]
        self.grads: list[torch.Tensor | None] = [None] * len(masters)
        self._squared_norms: list[torch.Tensor | None] = [None] * len(masters)

    def receive(self, index: int, shard: torch.Tensor) -> None:
        """Take bucket `index`'s final reduced gradient shard (call once per boundary backward)."""
        buffer = self._buffers[index]
        if shard.device == buffer.device and shard.dtype == buffer.dtype:
            grad = shard
        else:
            grad = buffer
            if shard.device != buffer.device and shard.dtype != buffer.dtype:
                # convert on the device first: torch converts a cross-device copy on the host, synchronously
                shard = shard.to(buffer.dtype)
            grad.copy_(shard, non_blocking=True)
        # Norm where the data is fastest to read: on the device for a GPU shard, on the fp32 host copy (no
        # up-cast temporary) for a CPU one.
        source = shard if shard.device.type != "cpu" else grad
        self._squared_norms[index] = torch.linalg.vector_norm(source, dtype=torch.float32) ** 2
        self.grads[index] = grad

    def squared_norm(self) -> torch.Tensor:
        """Sum of the received shards' squared norms (a 0-d tensor on the device the shards came from)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for value in self._squared_norms:
            if value is not None:
                total += value.to(self.device)
        return total

    def take(self) -> list[torch.Tensor]:
        """The host gradients, once every asynchronous copy has landed; the next backward refills them."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        grads = [g if g is not None else torch.zeros_like(b) for g, b in zip(self.grads, self._buffers)]
        self.grads = [None] * len(grads)
        self._squared_norms = [None] * len(grads)
        return grads


class NvmeOptimizerState:
    """Keeps the optimizer's per-element state for each master in files while it is not being stepped.

    The state of a master is either *resident* (in `optimizer.state` as usual) or *on disk* (its tensors in
    `<folder>/<index>.<key>.pt`, only scalars such as Adam's step left in `optimizer.state`).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], nvme_path: str, rank: int
    ):
        self.optimizer = optimizer
        self.masters = masters
        try:
            Path(nvme_path).mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix=f"shardspeed-optimizer-rank{rank}-", dir=nvme_path))
        except OSError as error:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.nvme_path: cannot create a swap folder in {nvme_path!r} "
                f"({error.strerror or error})"
            ) from error
        self._on_disk: dict[int, list[str]] = {}  # master index -> state keys written to files
        atexit.register(self.close)

    def _file(self, index: int, key: str) -> Path:
        return self.folder / f"{index}.{key}.pt"

    def swap_out(self, index: int) -> None:
        """Write the master's per-element state tensors to files and drop them from memory."""
        master = self.masters[index]
        state = self.optimizer.state.get(master)
        if not state or index in self._on_disk:
            return
        keys = [k for k, v in state.items() if torch.is_tensor(v) and v.numel() == master.numel() > 0]
        for key in keys:
            torch.save(state.pop(key), self._file(index, key))
        self._on_disk[index] = keys

    def swap_in(self, index: int) -> None:
        """Read the master's state tensors back into `optimizer.state`."""
        keys = self._on_disk.pop(index, None)
        if keys is None:
            return
        master = self.masters[index]
        group = next(g for g in self.optimizer.param_groups if any(p is master for p in g["params"]))
        loaded = {
            key: torch.load(self._file(index, key), map_location="cpu", weights_only=True) for key in keys
        }
        self.optimizer.state[master].update(place_optimizer_state(loaded, master, group, copy=False))

    @contextlib.contextmanager
    def resident(self):
        """Every master's state in memory (checkpoint save/load, state accessors), swapped out after."""
        for index in range(len(self.masters)):
            self.swap_in(index)
        try:
            yield
        finally:
            for index in range(len(self.masters)):
                self.swap_out(index)

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.folder.glob("*.pt")) if self.folder.exists() else 0

    def close(self) -> None:
        """Remove this rank's swap folder (made by mkdtemp for this run alone)."""
        shutil.rmtree(self.folder, ignore_errors=True)
