"""DeepSpeed's accelerator modules: CPU and CUDA build the device objects; the devices shardspeed does not run
on keep their DeepSpeed class names and refuse to be built, naming the device."""

from __future__ import annotations

import importlib

import pytest

import shardspeed as deepspeed  # noqa: F401  (installs the import table for `deepspeed.*` paths)

REFUSED = {
    "npu": "NPU_Accelerator",
    "xpu": "XPU_Accelerator",
    "hpu": "HPU_Accelerator",
    "mps": "MPS_Accelerator",
    "mlu": "MLU_Accelerator",
    "sdaa": "SDAA_Accelerator",
    "klxpu": "KLXPU_Accelerator",
    "supa": "SUPA_Accelerator",
}


@pytest.mark.parametrize("device", sorted(REFUSED))
def test_other_devices_refuse_by_name(device):
    module = importlib.import_module(f"shardspeed.accelerator.{device}_accelerator")
    accelerator_class = getattr(module, REFUSED[device])
    assert [name for name in dir(module) if name.endswith("_Accelerator")] == [REFUSED[device]]
    with pytest.raises(
        NotImplementedError, match=f"{REFUSED[device]}: shardspeed does not run on '{device}'"
    ):
        accelerator_class()


def test_cpu_and_cuda_build():
    from shardspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from shardspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    assert CPU_Accelerator().communication_backend_name() == "gloo"
    assert CUDA_Accelerator().communication_backend_name() == "nccl"
