"""DeepSpeed's `deepspeed.accelerator.cuda_accelerator`: the accelerator class for CUDA GPUs.

`set_accelerator(CUDA_Accelerator())` makes every later `get_accelerator()` answer for CUDA (NCCL); it is the
object `get_accelerator()` builds itself where a GPU is visible. Building one needs no GPU (as in DeepSpeed);
its device calls do.
"""

from __future__ import annotations

from shardspeed.accelerator.facade import DeviceAccelerator

__all__ = ["CUDA_Accelerator"]


class CUDA_Accelerator(DeviceAccelerator):  # DeepSpeed's class name
    """A CUDA GPU as DeepSpeed's accelerator object: device "cuda", communication backend "nccl"."""

    def __init__(self) -> None:
        super().__init__("cuda")
