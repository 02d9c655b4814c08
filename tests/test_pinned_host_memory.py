"""Pinned host memory: the native (mlock) backend really locks pages and unlocks them on unpin and at
collection, the accelerator dispatches to it by DS_PIN_MEMORY_BACKEND, and the tracker counts what is pinned."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from shardspeed.accelerator import CPU_Accelerator, native_pinning, pinned_tracker
from shardspeed.accelerator.native_pinning import NativePinnedMemory, get_active_native_pinned_memory
from shardspeed.accelerator.pinned_tracker import _fmt_bytes, _tracker, track_pinned_memory

PAGE = 4096


def _locked_kib() -> int:
    """The kernel's count of this process's locked memory (VmLck), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    pytest.skip("no VmLck in /proc/self/status")


def test_pin_locks_pages_and_unpin_unlocks_them():
    pins = NativePinnedMemory()
    before = _locked_kib()
    source = torch.arange(3 * PAGE // 4, dtype=torch.float32)  # three pages exactly
    pinned = pins.pin(source)
    assert _locked_kib() - before == 12
    assert torch.equal(pinned, source) and pinned.data_ptr() != source.data_ptr()
    assert pinned.ds_pinned is True and pins.is_pinned(pinned)
    view = pinned[PAGE // 4 :]
    assert not getattr(view, "ds_pinned", False) and pins.is_pinned(view)
    assert not pins.is_pinned(source)
    assert pins.unpin(pinned) is True
    assert _locked_kib() == before
    assert not pins.is_pinned(pinned) and not pins.is_pinned(view)
    assert float(view[0]) == PAGE // 4  # unpinned memory stays valid while the tensor lives
    assert pins.unpin(pinned) is False  # not ours any more


def test_collection_of_the_last_alias_unlocks():
    pins = NativePinnedMemory()
    before = _locked_kib()
    pinned = pins.pin(torch.ones(10, dtype=torch.bfloat16))
    begin = pinned.ds_pin_base
    view = pinned.narrow(0, 2, 4)
    del pinned
    gc.collect()
    assert begin in pins._ranges and _locked_kib() - before == 4  # the view still holds the buffer
    del view
    gc.collect()
    assert begin not in pins._ranges and _locked_kib() == before


def test_shapes_flags_and_storageless_tensors():
    pins = NativePinnedMemory()
    source = torch.randn(4, 8)
    assert pins.pin(source, match_shape=False).shape == (32,)
    scratch = pins.pin(source, make_copy=False)
    assert scratch.shape == (4, 8) and scratch.dtype == source.dtype and pins.is_pinned(scratch)
    empty = pins.pin_empty(torch.empty(0, dtype=torch.float16), (3, 5))
    assert empty.shape == (3, 5) and empty.dtype == torch.float16 and pins.is_pinned(empty)
    assert pins.is_pinned(torch.zeros(2, device="meta")) is False
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        assert pins.is_pinned(mode.from_tensor(torch.zeros(2))) is False


def test_accelerator_dispatches_by_backend_variable(monkeypatch):
    accelerator = CPU_Accelerator()
    tensor = torch.arange(6.0)
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    assert get_active_native_pinned_memory() is None
    assert accelerator.pin_memory(tensor) is tensor  # torch cannot page-lock on CPU: DeepSpeed's no-op
    assert accelerator.is_pinned(tensor) is False and accelerator.unpin_memory(tensor) is None

    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    monkeypatch.setattr(native_pinning, "_shared_native_pins", None)
    _tracker.reset()
    pinned = accelerator.pin_memory(tensor)
    assert torch.equal(pinned, tensor) and accelerator.is_pinned(pinned) and accelerator.is_pinned(pinned[2:])
    assert _tracker._bytes == tensor.nbytes and _tracker._calls == 1
    assert accelerator.unpin_memory(pinned) is True and not accelerator.is_pinned(pinned)
    _tracker.reset()

    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "nativ")
    with pytest.raises(ValueError, match="DS_PIN_MEMORY_BACKEND='nativ'"):
        accelerator.pin_memory(tensor)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_tracker_totals_milestones_and_format():
    assert [_fmt_bytes(n) for n in (512, 2048, 2**20, 3 * 2**29)] == [
        "512 B",
        "2.0 KB",
        "1.00 MB",
        "1.500 GB",
    ]
    gib = 1024**3
    _tracker.reset()
    logger, lines = logging.getLogger("shardspeed"), _Lines()
    logger.addHandler(lines)
    try:
        track_pinned_memory(30 * gib)
        assert _tracker._next_checkpoint == 32 * gib and lines.lines == []
        track_pinned_memory(110 * gib)  # 140 GiB: crosses 32, 64 and 128 in one call
        pinned_tracker.pinned_memory_summary("end")
    finally:
        logger.removeHandler(lines)
    assert _tracker._bytes == 140 * gib and _tracker._calls == 2 and _tracker._next_checkpoint == 256 * gib
    crossed = [line.split("crossed ")[1].split(":")[0] for line in lines.lines if "checkpoint" in line]
    assert crossed == ["32.000 GB", "64.000 GB", "128.000 GB"]
    assert lines.lines[-1] == "[pinned-memory end] 140.000 GB pinned across 2 allocations"
    _tracker.reset()
    assert (_tracker._bytes, _tracker._calls) == (0, 0)


def _offloaded_masters_native(stage: int) -> dict:
    import os

    import shardspeed
    from shardspeed.accelerator import native_pinning as pinning

    os.environ["DS_PIN_MEMORY_BACKEND"] = "native"
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    loss = engine(torch.randn(2, 16, dtype=torch.bfloat16)).float().square().mean()
    engine.backward(loss)
    engine.step()
    pins = pinning.get_active_native_pinned_memory()
    masters_pinned = all(pins.is_pinned(m) for m in engine.optimizer.masters)
    before = len(pins._ranges)
    engine.destroy()
    return {"masters_pinned": masters_pinned, "before": before, "after": len(pins._ranges)}


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_masters_are_natively_pinned_until_destroy(stage):
    from harness import run_ranks

    (result,) = run_ranks(_offloaded_masters_native, 1, stage)
    assert result["masters_pinned"] and result["before"] > 0 and result["after"] == 0
