"""The device and backend choice: CUDA with NCCL where a GPU is visible, CPU with Gloo otherwise, and the few
device calls the rest of the package makes through it. `shardspeed.accelerator` exports these; the
DeepSpeed-style accelerator object (facade.py) asks `has_cuda` here which device type to wrap."""

from __future__ import annotations

import os

import torch

__all__ = [
    "default_backend",
    "device_for_local_rank",
    "has_cuda",
    "memory_allocated",
    "set_device",
    "synchronize",
]


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
