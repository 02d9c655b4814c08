"""Device and backend choice: CUDA with NCCL where a GPU is visible, CPU with Gloo otherwise.

Everything device-specific (which backend, which device for a local rank, memory statistics) is asked here
(written in device.py), so the rest of the package is written once for both. `get_accelerator()` returns
the same choice as an object with DeepSpeed's `deepspeed.accelerator` method names, for code written
against DeepSpeed (see facade.py).
"""

from __future__ import annotations

import functools

from shardspeed.accelerator.cpu_accelerator import CPU_Accelerator
from shardspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from shardspeed.accelerator.device import (
    default_backend,
    device_for_local_rank,
    has_cuda,
    memory_allocated,
    set_device,
    synchronize,
)
from shardspeed.accelerator.facade import chosen, set_current


@functools.cache
def _automatic(device_type: str):
    return CUDA_Accelerator() if device_type == "cuda" else CPU_Accelerator()


def get_accelerator():
    """The DeepSpeed-style accelerator object for this process: the one `set_accelerator` installed, else
    DeepSpeed's CUDA_Accelerator where `has_cuda()`, else its CPU_Accelerator."""
    installed = chosen()
    return installed if installed is not None else _automatic("cuda" if has_cuda() else "cpu")


def set_accelerator(accelerator) -> None:
    """DeepSpeed's `set_accelerator`: make `accelerator` (a shardspeed accelerator object) the current one."""
    set_current(accelerator)


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator is one shardspeed supports: always, since it picks only CUDA or CPU."""
    return get_accelerator().device_name() in ("cuda", "cpu")


__all__ = [
    "CPU_Accelerator",
    "CUDA_Accelerator",
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
