"""Flat-tensor reduce-scatter and all-gather, as fast as each backend allows. ZeRO calls these two helpers.

torch 2.13 renamed `reduce_scatter_tensor`/`all_gather_into_tensor` to `reduce_scatter_single`/
`all_gather_single` (the old names warn); torch 2.4 has only the old ones.

On Gloo both collectives are slow compared with the primitives they could be built from. Measured with
torch 2.13 on 2 CPU ranks over loopback (fp32, median of 5):

| elements | all_reduce | reduce_scatter | reduce to each owner | all_gather | broadcast from each owner |
|---|---|---|---|---|---|
| 6.5M (one 25 MiB bucket) | 19.8 ms | 20.1 ms | 17.2 ms | 10.9 ms | 7.1 ms |
| 29M | 61 ms | 119 ms | 64 ms | 98 ms | 24 ms |

So with Gloo a reduce-scatter is one `reduce` per slice to the rank that owns it, and an all-gather is one
`broadcast` per slice from its owner — the same results (sums of the same values, copies of the same bits),
issued in the same order on every rank. NCCL (and any other backend) uses the native collectives.

Every collective of a training step (gradient all-reduce/reduce-scatter, parameter all-gathers, the norm's
all-reduce, Ulysses' all-to-alls) goes through this module, so the comms logger (`comm/logger.py`) sees each one once, under its
logical name (a Gloo reduce-scatter is logged as one `reduce_scatter_tensor`, not as its per-slice reduces).
With the logger off the only cost is one `is None` check. (Start-up broadcasts and checkpoint barriers call
torch directly and are not logged.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm import logger

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Works:
    """Several in-flight collectives behind one `wait()`, then an optional finishing copy."""

    def __init__(self, works: list, finish=None):
        self.works, self.finish = works, finish

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True


def completed_work() -> _Works:
    """A handle whose `wait()` returns at once, for work that needed no collective."""
    return _Works([])


def then(work, finish) -> _Works:
    """A handle whose `wait()` waits for `work` (an in-flight collective), then runs `finish()` — the local
    work that uses what arrived (ZeRO++ dequantizes there)."""
    return _Works([work], finish)


def _local(output: torch.Tensor, input: torch.Tensor, async_op: bool):
    """A world of one: `output` is `input` (copied unless they are the same memory)."""
    if not _same_memory(output, input):
        output.copy_(input)
    handle = _Works([])
    return handle if async_op else handle.wait()


def _per_slice(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _slices(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    size = tensor.numel() // world
    return [tensor[i * size : (i + 1) * size] for i in range(world)]


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """`torch.distributed.all_reduce`, seen by the comms logger."""
    log = logger.active()
    if log is None:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    run = lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op)  # noqa: E731
    return log.timed("all_reduce", _nbytes(tensor), run, group=group)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`torch.distributed.all_to_all_single` (Ulysses' exchange), seen by the comms logger."""
    log = logger.active()
    if log is None:
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)
    run = lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op)  # noqa: E731
    return log.timed("all_to_all_single", _nbytes(input), run, group=group)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum `input` (world_size equal slices) across ranks; this rank's slice of the sum lands in `output`.

    `output` may be this rank's slice of `input` itself (in place). The other slices of `input` are scratch
    afterwards.
    """
    log = logger.active()
    if log is None:
        return _reduce_scatter_flat(output, input, group, async_op)
    run = lambda: _reduce_scatter_flat(output, input, group, async_op)  # noqa: E731
    return log.timed("reduce_scatter_tensor", _nbytes(input), run, group=group)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `input` into `output`; `input` may be this rank's slice of `output`."""
    log = logger.active()
    if log is None:
        return _all_gather_flat(output, input, group, async_op)
    run = lambda: _all_gather_flat(output, input, group, async_op)  # noqa: E731
    return log.timed("all_gather_into_tensor", _nbytes(output), run, group=group)


def _reduce_scatter_flat(output, input, group, async_op):
    if dist.get_world_size(group) == 1:  # the sum of one rank's values: no collective
        return _local(output, input, async_op)
    if not _per_slice(group):
        return _reduce_scatter(output, input, group=group, async_op=async_op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    slices = _slices(input, world)
    works = [
        dist.reduce(part, dst=_global(group, i), group=group, async_op=True) for i, part in enumerate(slices)
    ]
    own = slices[rank]
    handle = _Works(works, None if _same_memory(own, output) else lambda: output.copy_(own))
    return handle if async_op else handle.wait()


def _all_gather_flat(output, input, group, async_op):
    if dist.get_world_size(group) == 1:
        return _local(output, input, async_op)
    if not _per_slice(group):
        return _all_gather(output, input, group=group, async_op=async_op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    slices = _slices(output, world)
    if not _same_memory(slices[rank], input):
        slices[rank].copy_(input)
    works = [
        dist.broadcast(part, src=_global(group, i), group=group, async_op=True)
        for i, part in enumerate(slices)
    ]
    handle = _Works(works)
    return handle if async_op else handle.wait()


def all_gather_strings(text: str, device: torch.device, group=None) -> list[str]:
    """Every rank's `text`, in rank order. Sent as byte tensors, not pickles: torch's `*_object` collectives
    need NumPy, which a clean install does not have."""
    world = dist.get_world_size(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(g[: int(n)].tolist()).decode() for g, n in zip(gathered, lengths)]


def comm_device(group=None) -> torch.device:
    """Where tensors handed to `group`'s collectives must live: the current GPU for NCCL, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


def broadcast_bytes(payload: bytes | None, src: int, group=None) -> bytes:
    """`payload` of global rank `src`, on every rank of `group` (others pass None). Sent as a byte tensor,
    not a pickle through torch's `broadcast_object_list`, which needs NumPy (absent from a clean install)."""
    device = comm_device(group)
    mine = dist.get_rank() == src
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if mine and payload else torch.empty(0)
    length = torch.tensor([data.numel() if mine else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    buffer = data.to(device) if mine else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return bytes(buffer.cpu().tolist()) if not mine else bytes(payload or b"")
