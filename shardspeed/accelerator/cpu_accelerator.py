"""DeepSpeed's `deepspeed.accelerator.cpu_accelerator`: the accelerator class for the CPU.

`set_accelerator(CPU_Accelerator())` makes every later `get_accelerator()` answer for the CPU (Gloo), whatever
`has_cuda()` would choose; it is the object `get_accelerator()` builds itself on a machine without a GPU.
"""

from __future__ import annotations

from shardspeed.accelerator.facade import DeviceAccelerator

__all__ = ["CPU_Accelerator"]


class CPU_Accelerator(DeviceAccelerator):  # DeepSpeed's class name
    """The CPU as DeepSpeed's accelerator object: device "cpu", communication backend "gloo"."""

    def __init__(self) -> None:
        super().__init__("cpu")
