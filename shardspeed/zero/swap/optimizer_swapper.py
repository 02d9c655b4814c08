"""`offload_optimizer: nvme`: fp32 master shards *and* their optimizer state live in files between steps.

The optimizer steps one sub-group (one master: a ZeRO bucket or stage 3 unit shard, at most
`sub_group_size` elements) at a time. For each sub-group the master and every per-element state tensor
(Adam's two moments) are read into freshly allocated page-aligned buffers, stepped, and written back; the
buffers are dropped once the write lands, so memory holds only the sub-groups in flight:

- `pipeline_read`: the next sub-group's read is issued before the current one steps;
- `pipeline_write`: the current sub-group's write is left in flight while the next one steps;
- `buffer_count`: at most this many sub-groups are in memory at once (reading, stepping or writing); the
  oldest write is waited for before another read starts. Pipelining needs at least 2.

Gradients (stages 2 and 3) go to the same files: each reduced gradient slice is added to its sub-group's
gradient file during backward (`accumulate_gradient`: written as is by the first micro-step of an
accumulation window, read, summed and rewritten by the later ones), and the step reads it with the master
and the state. So no gradient shard stays in memory between backward and step.

A master that is swapped out keeps its identity (it is the optimizer's key) with empty `.data`. Scalar
state (Adam's `step`) stays in `optimizer.state`. `resident(indices)` brings sub-groups in for the state
accessors and checkpoint loads, one at a time; saves read `mapped` views of the files. So a model larger
than memory can be saved and loaded.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from shardspeed.core.placement import place_optimizer_state
from shardspeed.zero.swap.aio import AsyncFileIO, IoRequest, aligned_empty
from shardspeed.zero.swap.folder import SwapFolder

__all__ = ["OptimizerSwapper"]

MASTER = "master"
GRADIENT = "grad"


class OptimizerSwapper:
    """Swaps masters and their per-element optimizer state between memory and `folder`, sub-group by
    sub-group (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, folder: SwapFolder, io: AsyncFileIO, *,
                 buffer_count: int = 4, pipeline_read: bool = False, pipeline_write: bool = False,
                 pin_memory: bool = False):  # fmt: skip
        self.optimizer, self.io = optimizer, io
        self.masters: list[torch.Tensor] = []
        self.folder_files = folder
        self.buffer_count = max(1, buffer_count)
        self.pipeline_read = pipeline_read and self.buffer_count >= 2
        self.pipeline_write = pipeline_write and self.buffer_count >= 2
        self.pin = pin_memory
        self.numels: list[int] = []
        self._keys: dict[int, list[tuple[str, torch.dtype]]] = {}  # index -> tensors on disk (in order)
        self._reads: dict[int, tuple[list[IoRequest], dict[str, torch.Tensor]]] = {}
        self._writes: OrderedDict[int, list[IoRequest]] = OrderedDict()
        self._resident: set[int] = set()
        self._gradient_dtypes: dict[int, torch.dtype] = {}  # sub-groups with a gradient in their file
        self._gradients: dict[int, torch.Tensor] = {}  # gradients read in with their sub-group

    def adopt(self, master: torch.Tensor) -> None:
        """Take the next master (index = order of adoption) and send it to its file; at most
        `buffer_count` writes are left in flight."""
        index = len(self.masters)
        self.masters.append(master)
        self.numels.append(master.numel())
        self._resident.add(index)
        self.swap_out(index, wait=False)
        while len(self._writes) > self.buffer_count:
            self._wait_writes(next(iter(self._writes)))

    @property
    def folder(self):
        return self.folder_files.path

    def _file(self, index: int, key: str) -> str:
        return self.folder_files.file(f"{index}.{key}")

    def _in_memory(self) -> int:
        return len(self._resident) + len(self._reads) + len(self._writes)

    # -- one sub-group ------------------------------------------------------------------------------------

    def prefetch(self, index: int, gradient: bool = False) -> None:
        """Start reading sub-group `index`, with its gradient when asked (no-op if it is in memory or
        already being read)."""
        if index in self._resident or index in self._reads or index not in self._keys:
            return
        self._wait_writes(index)
        while self._writes and self._in_memory() >= self.buffer_count:
            self._wait_writes(next(iter(self._writes)))
        buffers, requests = {}, []
        keys = list(self._keys[index])
        if gradient and index in self._gradient_dtypes:
            keys.append((GRADIENT, self._gradient_dtypes[index]))
        for key, dtype in keys:
            buffers[key] = aligned_empty(self.numels[index], dtype, pin=self.pin)
            requests.append(self.io.read(buffers[key], self._file(index, key)))
        self._reads[index] = (requests, buffers)

    def swap_in(self, index: int, gradient: bool = False) -> None:
        """Sub-group `index`'s master and state (and its gradient, when asked) in memory; waits for the read."""
        if index in self._resident:
            return
        self.prefetch(index, gradient)
        requests, buffers = self._reads.pop(index)
        for request in requests:
            request.wait()
        if GRADIENT in buffers:
            self._gradients[index] = buffers.pop(GRADIENT)
        master = self.masters[index]
        master.data = buffers.pop(MASTER)
        if buffers:
            group = next(g for g in self.optimizer.param_groups if any(p is master for p in g["params"]))
            placed = place_optimizer_state(buffers, master, group, copy=False)
            self.optimizer.state[master].update(placed)
        self._resident.add(index)

    def swap_out(self, index: int, wait: bool = True) -> None:
        """Write sub-group `index`'s master and per-element state to files and drop them from memory."""
        if index not in self._resident:
            return
        master = self.masters[index]
        state = self.optimizer.state.get(master, {})
        tensors = {MASTER: master.data}
        for key in [k for k, v in state.items() if torch.is_tensor(v) and v.numel() == master.numel() > 0]:
            tensors[key] = state.pop(key)
        self._keys[index] = [(key, t.dtype) for key, t in tensors.items()]
        requests = [
            self.io.write(_aligned(t, self.pin), self._file(index, key)) for key, t in tensors.items()
        ]
        master.data = torch.empty(0, dtype=master.dtype, device=master.device)
        self._resident.discard(index)
        self._writes[index] = requests
        if wait:
            self._wait_writes(index)

    # -- gradients ----------------------------------------------------------------------------------------

    def accumulate_gradient(
        self, index: int, reduced: torch.Tensor, scale: float, fresh: bool
    ) -> torch.Tensor:
        """Add `scale * reduced` to sub-group `index`'s gradient file (`fresh`: the first reduction of an
        accumulation window, written as is). Returns the sum, which stays valid while its write is in flight
        (the caller takes its norm); at most `buffer_count` sub-groups are in flight."""
        source = reduced if reduced.device.type == "cpu" else reduced.to("cpu")
        if fresh:
            total = aligned_empty(reduced.numel(), source.dtype, pin=self.pin)
            torch.mul(source, scale, out=total)
        else:
            total = self._read_gradient(index, self._gradient_dtypes[index])
            total.add_(source, alpha=scale)
        self._gradients.pop(index, None)  # a copy read before this backward is stale now
        self._gradient_dtypes[index] = total.dtype
        self._writes.setdefault(index, []).append(self.io.write(total, self._file(index, GRADIENT)))
        self._writes.move_to_end(index)
        while len(self._writes) > self.buffer_count:
            self._wait_writes(next(iter(self._writes)))
        return total

    def gradient(self, index: int, consume: bool = True) -> torch.Tensor:
        """Sub-group `index`'s accumulated gradient, read with the sub-group or now (zeros when nothing was
        reduced since `forget_gradients`). Consumed by the step (the next backward starts a new one); the
        state accessors read a copy (`consume=False`)."""
        dtype, found = self._gradient_dtypes.get(index), self._gradients.get(index)
        if consume:
            self._gradient_dtypes.pop(index, None)
            self._gradients.pop(index, None)
        if found is not None:
            return found if consume else found.clone()
        if dtype is None:
            return torch.zeros(self.numels[index], dtype=torch.float32)
        return self._read_gradient(index, dtype)

    def forget_gradients(self) -> None:
        """`zero_grad`: the gradients in the files are no longer wanted."""
        self._gradient_dtypes.clear()
        self._gradients.clear()

    def _read_gradient(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        self._wait_writes(index)
        buffer = aligned_empty(self.numels[index], dtype, pin=self.pin)
        return self.io.read(buffer, self._file(index, GRADIENT)).wait()

    def _wait_writes(self, index: int) -> None:
        for request in self._writes.pop(index, []):
            request.wait()

    def drain(self) -> None:
        """Wait for every write in flight."""
        for index in list(self._writes):
            self._wait_writes(index)

    # -- the step and whole-state access --------------------------------------------------------------------

    def step_each(self, step_one) -> None:
        """Call `step_one(index)` for every sub-group with its state in memory, reads and writes pipelined
        as configured."""
        count = len(self.masters)
        for index in range(count):
            self.swap_in(index, gradient=True)
            if self.pipeline_read and index + 1 < count:
                self.prefetch(index + 1, gradient=True)
            step_one(index)
            self.swap_out(index, wait=not self.pipeline_write)
        self.drain()

    def mapped(self, index: int) -> tuple[torch.Tensor, dict]:
        """Sub-group `index`'s master and optimizer state for reading (checkpoint saves), without bringing
        it into memory: a swapped-out sub-group's tensors are private, read-only-by-contract mappings of its
        files (pages are read when touched and stay reclaimable); a resident one's are its own tensors."""
        master = self.masters[index]
        state = dict(self.optimizer.state.get(master, {}))
        if index in self._resident:
            return master.data, state
        self._wait_writes(index)
        tensors = {
            key: torch.from_file(self._file(index, key), shared=False, size=self.numels[index], dtype=dtype)
            for key, dtype in self._keys[index]
        }
        return tensors.pop(MASTER), {**state, **tensors}

    @contextlib.contextmanager
    def resident(self, indices=None):
        """Sub-groups `indices` (default all) in memory for the duration; written back after (checkpoint
        loads and `safe_set_*` change them)."""
        chosen = list(range(len(self.masters))) if indices is None else list(indices)
        already = {i for i in chosen if i in self._resident}
        for index in chosen:
            self.swap_in(index)
        try:
            yield
        finally:
            for index in chosen:
                if index not in already:
                    self.swap_out(index, wait=False)
            self.drain()

    def disk_bytes(self) -> int:
        return self.folder_files.disk_bytes()

    def close(self) -> None:
        self.drain()
        self.io.close()  # its threads end (a pool shared with the parameter tier may be closed twice)
        self.folder_files.close()


def _aligned(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """`tensor` itself when it is a contiguous CPU tensor; else a page-aligned host copy to write from."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor
    copy = aligned_empty(tensor.numel(), tensor.dtype, pin=pin)
    copy.copy_(tensor.reshape(-1))
    return copy
