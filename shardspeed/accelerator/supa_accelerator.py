"""DeepSpeed's `deepspeed.accelerator.supa_accelerator`: Biren SUPA devices, which shardspeed does not run on
(other_devices.py); the class exists so that importing it works, and building one says so."""

from __future__ import annotations

from shardspeed.accelerator.other_devices import UnsupportedDeviceAccelerator

__all__ = ["SUPA_Accelerator"]


class SUPA_Accelerator(UnsupportedDeviceAccelerator):  # DeepSpeed's class name
    device = "supa"
