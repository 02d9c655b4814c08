"""ZeRO-Infinity's NVMe tier: asynchronous file I/O (aio.py), swap folders (folder.py), and the swappers
that keep optimizer state (optimizer_swapper.py) and stage 3 parameter shards (param_swapper.py) in files."""

from __future__ import annotations

from shardspeed.zero.swap.aio import AioSettings, AsyncFileIO, aligned_empty
from shardspeed.zero.swap.folder import SwapFolder, check_nvme_path, remove_stale_folders
from shardspeed.zero.swap.optimizer_swapper import OptimizerSwapper

__all__ = [
    "AioSettings",
    "AsyncFileIO",
    "OptimizerSwapper",
    "SwapFolder",
    "aligned_empty",
    "build_optimizer_swapper",
    "check_nvme_path",
    "remove_stale_folders",
]

OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"


def build_optimizer_swapper(optimizer, numels: list[int], offload, rank: int,
                            io: AsyncFileIO | None = None) -> OptimizerSwapper:  # fmt: skip
    """The NVMe optimizer tier for masters of `numels` elements (handed over with `adopt`): its folder is
    checked for room for each master, two same-sized state tensors (Adam's moments) and the gradient, in
    fp32: 16 bytes per element. `io`: the parameter tier's I/O pool, shared so that one rank's requests
    share one queue (`aio.queue_depth`)."""
    folder = SwapFolder(offload.nvme_path, "optimizer", rank, 16 * sum(numels), OPTIMIZER_KEY)
    return OptimizerSwapper(
        optimizer,
        folder,
        io if io is not None else AsyncFileIO(offload.aio),
        buffer_count=offload.buffer_count,
        pipeline_read=offload.pipeline_read,
        pipeline_write=offload.pipeline_write,
        pin_memory=offload.pin_memory,
    )
