"""DeepSpeed's `deepspeed.accelerator.klxpu_accelerator`: Kunlunxin XPU devices, which shardspeed does not run on
(other_devices.py); the class exists so that importing it works, and building one says so."""

from __future__ import annotations

from shardspeed.accelerator.other_devices import UnsupportedDeviceAccelerator

__all__ = ["KLXPU_Accelerator"]


class KLXPU_Accelerator(UnsupportedDeviceAccelerator):  # DeepSpeed's class name
    device = "klxpu"
