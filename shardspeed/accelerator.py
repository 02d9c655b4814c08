"""Device and backend choice: CUDA with NCCL where a GPU is visible, CPU with Gloo otherwise.

Everything device-specific (which backend, which device for a local rank, memory statistics) is asked here,
so the rest of the package is written once for both.
"""

from __future__ import annotations

import os

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("SHARDSPEED_ACCELERATOR", "").lower() != "cpu"


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
