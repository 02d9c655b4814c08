"""Device and backend choice: CUDA with NCCL where a GPU is visible, CPU with Gloo otherwise.

Everything device-specific (which backend, which device for a local rank, memory statistics) is asked here,
so the rest of the package is written once for both. `get_accelerator()` returns the same choice as an object
with DeepSpeed's `deepspeed.accelerator` method names, for code written against DeepSpeed (see facade.py).
"""

from __future__ import annotations

import os

import torch


def has_cuda() -> bool:
    """A usable GPU, unless SHARDSPEED_ACCELERATOR=cpu (or DeepSpeed's DS_ACCELERATOR=cpu) asks for the CPU."""
    forced = os.environ.get("SHARDSPEED_ACCELERATOR") or os.environ.get("DS_ACCELERATOR") or ""
    return torch.cuda.is_available() and forced.lower() != "cpu"


def default_backend() -> str:
    """NCCL on CUDA, Gloo on CPU."""
    return "nccl" if has_cuda() else "gloo"


def device_for_local_rank(local_rank: int) -> torch.device:
    if has_cuda():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work; a no-op on CPU. Timers call this to measure real work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def get_accelerator():
    """The DeepSpeed-style accelerator object for this process (CUDA or CPU, chosen as `has_cuda`)."""
    from shardspeed.accelerator.facade import current

    return current()


def set_accelerator(accelerator) -> None:
    """DeepSpeed's `set_accelerator`: make `accelerator` (a shardspeed accelerator object) the current one."""
    from shardspeed.accelerator.facade import set_current

    set_current(accelerator)


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator is one shardspeed supports: always, since it picks only CUDA or CPU."""
    return get_accelerator().device_name() in ("cuda", "cpu")


__all__ = [
    "default_backend",
    "device_for_local_rank",
    "get_accelerator",
    "has_cuda",
    "is_current_accelerator_supported",
    "memory_allocated",
    "set_accelerator",
    "set_device",
    "synchronize",
]
