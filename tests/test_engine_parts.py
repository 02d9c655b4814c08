"""The engine's small parts, one process, no process group: attribute look-up on the module, the module's
dtypes (`data_types`), the Python GC switch (`disable_python_gc`), torch_autocast's marks. The throughput
timer is tested in test_throughput_timer.py, `checkpointing.checkpoint` keyword arguments in
test_activation_checkpointing.py."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from shardspeed.config.blocks import DataTypesConfig
from shardspeed.core.autocast import TorchAutocast
from shardspeed.core.module_dtypes import cast_module
from shardspeed.runtime.engine_extras import EngineExtras
from shardspeed.runtime.python_gc import PythonGC

# -- engine.<attribute of the model> -------------------------------------------------------------------------


class _Model(nn.Module):
    config_class = "LlamaConfig"
    supports_gradient_checkpointing = True

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.broken = "the module's value"

    def gradient_checkpointing_enable(self):
        return "enabled"


class _Engine(EngineExtras, nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    @property
    def broken(self):
        return self.missing_helper  # a bug inside an engine property: an AttributeError of its own

    @property
    def fine(self):
        return "engine property"


def test_engine_forwards_unknown_attributes_to_the_module():
    engine = _Engine(_Model())
    assert engine.config_class == "LlamaConfig" and engine.supports_gradient_checkpointing
    assert engine.gradient_checkpointing_enable() == "enabled"
    assert engine.lin is engine.module.lin
    assert engine.fine == "engine property"  # the engine's own attributes win
    with pytest.raises(AttributeError, match=r"'_Engine' object \(and its module\) has no attribute 'nope'"):
        _ = engine.nope


def test_an_engine_property_failing_inside_is_not_masked_by_the_module():
    engine = _Engine(_Model())
    # The module has `broken` too, but the engine's property raised: its own error must surface.
    with pytest.raises(AttributeError, match="missing_helper"):
        _ = engine.broken


# -- data_types: param_dtype, buffer_dtype, keep_in_fp32_modules ---------------------------------------------


class _WithBuffers(nn.Module):
    _keep_in_fp32_modules_strict = ["router"]

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.rand(4))
        self.router = nn.Module()
        self.router.register_buffer("bias", torch.rand(4).half())
        self.register_buffer("positions", torch.arange(4))


def _dtypes(module) -> dict:
    return {n: t.dtype for n, t in [*module.named_parameters(), *module.named_buffers()]}


def test_parameters_take_the_training_dtype_and_buffers_keep_theirs():
    model = _WithBuffers()
    cast_module(model, torch.bfloat16, DataTypesConfig(keep_in_fp32_modules=[]))
    got = _dtypes(model)
    assert got["lin.weight"] == torch.bfloat16 and got["lin.bias"] == torch.bfloat16
    assert got["inv_freq"] == torch.float32  # an fp32 rotary table stays fp32, as DeepSpeed 0.19
    assert got["router.bias"] == torch.float16 and got["positions"] == torch.int64


def test_buffer_dtype_casts_the_floating_buffers():
    model = _WithBuffers()
    cast_module(model, torch.bfloat16, DataTypesConfig(buffer_dtype="bf16", keep_in_fp32_modules=[]))
    got = _dtypes(model)
    assert got["inv_freq"] == got["router.bias"] == torch.bfloat16 and got["positions"] == torch.int64


def test_keep_in_fp32_modules_auto_reads_the_models_own_list_and_wins_over_buffer_dtype():
    model = _WithBuffers()
    cast_module(model, torch.bfloat16, DataTypesConfig(buffer_dtype="bf16"))  # "auto"
    got = _dtypes(model)
    assert got["router.bias"] == torch.float32  # named by _keep_in_fp32_modules_strict: upcast, kept
    assert got["inv_freq"] == torch.bfloat16


def test_keep_in_fp32_modules_patterns_match_anywhere_in_the_name():
    model = _WithBuffers()
    cast_module(model, torch.float16, DataTypesConfig(buffer_dtype="fp16", keep_in_fp32_modules=["inv_*"]))
    got = _dtypes(model)
    assert got["inv_freq"] == torch.float32 and got["router.bias"] == torch.float16


def test_fp32_training_keeps_everything_as_loaded():
    model = _WithBuffers()
    cast_module(model, torch.float32, DataTypesConfig())
    assert _dtypes(model)["router.bias"] == torch.float16 and _dtypes(model)["lin.weight"] == torch.float32


# -- disable_python_gc -------------------------------------------------------------------------------------------


def test_python_gc_is_off_while_an_engine_holds_it_and_restored_after_the_last():
    switch = PythonGC()
    assert gc.isenabled()
    switch.acquire()
    switch.acquire()  # a second engine
    assert not gc.isenabled() and switch.holders == 2
    switch.release()
    assert not gc.isenabled()
    switch.release()
    assert gc.isenabled() and switch.holders == 0
    switch.release()  # one release too many changes nothing
    assert gc.isenabled()


def test_python_gc_left_off_when_it_was_off_before():
    gc.disable()
    try:
        switch = PythonGC()
        switch.acquire()
        switch.release()
        assert not gc.isenabled()
    finally:
        gc.enable()


# -- torch_autocast ----------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.conv = nn.Linear(4, 4), nn.LayerNorm(4), nn.Conv1d(1, 1, 1)


def test_autocast_marks_the_lower_precision_safe_modules_for_communication():
    block = _Block()
    TorchAutocast(True, "cpu", torch.bfloat16).mark_safe_modules(block, None)  # torch's Linear and Conv
    assert block.lin.weight.comm_dtype == torch.bfloat16 and block.conv.weight.comm_dtype == torch.bfloat16
    assert not hasattr(block.norm.weight, "comm_dtype")
    other = _Block()
    TorchAutocast(True, "cpu", torch.bfloat16).mark_safe_modules(
        other, ["torch.nn.modules.normalization.LayerNorm"]
    )
    assert hasattr(other.norm.weight, "comm_dtype") and not hasattr(other.lin.weight, "comm_dtype")


def test_autocast_refuses_a_class_it_cannot_import():
    with pytest.raises(ValueError, match=r"lower_precision_safe_modules: cannot import 'no\.such\.Module'"):
        TorchAutocast(True, "cpu", torch.bfloat16).mark_safe_modules(_Block(), ["no.such.Module"])


def test_autocast_follows_the_config_inside_an_outer_autocast():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    on, off = TorchAutocast(True, "cpu", torch.bfloat16), TorchAutocast(False, "cpu")
    with on.context():
        assert lin(x).dtype == torch.bfloat16
    # the engine's config says no autocast: an outer one is switched off inside
    with torch.autocast("cpu", dtype=torch.bfloat16), off.context():
        assert lin(x).dtype == torch.float32
    with off.context():
        assert lin(x).dtype == torch.float32
