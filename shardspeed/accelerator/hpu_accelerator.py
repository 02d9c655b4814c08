"""DeepSpeed's `deepspeed.accelerator.hpu_accelerator`: Intel Gaudi devices, which shardspeed does not run on
(other_devices.py); the class exists so that importing it works, and building one says so."""

from __future__ import annotations

from shardspeed.accelerator.other_devices import UnsupportedDeviceAccelerator

__all__ = ["HPU_Accelerator"]


class HPU_Accelerator(UnsupportedDeviceAccelerator):  # DeepSpeed's class name
    device = "hpu"
