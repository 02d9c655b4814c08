"""DeepSpeed's `deepspeed.accelerator.mps_accelerator`: Apple MPS devices, which shardspeed does not run on
(other_devices.py); the class exists so that importing it works, and building one says so."""

from __future__ import annotations

from shardspeed.accelerator.other_devices import UnsupportedDeviceAccelerator

__all__ = ["MPS_Accelerator"]


class MPS_Accelerator(UnsupportedDeviceAccelerator):  # DeepSpeed's class name
    device = "mps"
