"""DeepSpeed's accelerator classes for the devices shardspeed does not run on (Ascend NPU, Intel XPU, Gaudi
HPU, Apple MPS, Cambricon MLU, Tecorigin SDAA, Kunlunxin XPU, Biren SUPA).

Each keeps DeepSpeed's class name in DeepSpeed's module (npu_accelerator.py, ...), so code and tests that
import them, list them or subclass them keep working; building one raises, naming the device, since
shardspeed drives only CUDA and the CPU (its collectives are NCCL or Gloo, its device calls torch.cuda's).
"""

from __future__ import annotations

from shardspeed.accelerator.facade import DeviceAccelerator

__all__ = ["UnsupportedDeviceAccelerator"]


class UnsupportedDeviceAccelerator(DeviceAccelerator):
    """The base of the refused device classes: the interface of DeviceAccelerator, and a constructor that
    says the device is not supported. `device` is DeepSpeed's name for the device type."""

    device = ""

    def __init__(self) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}: shardspeed does not run on {self.device!r} devices; it runs on CUDA "
            "(CUDA_Accelerator) and the CPU (CPU_Accelerator)"
        )
