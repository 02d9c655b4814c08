"""Offloading checkpointed hidden states: marked layer inputs leave the device between forward and backward and
come back for it, with gradients equal to a run without offload.

The CPU has no separate device memory, so the class offloads nothing there (as DeepSpeed's); to exercise the
copy out and the copy back here, `HostAsDevice` treats CPU tensors as device tensors; the last test runs the
class itself on a CUDA GPU, with and without side streams, where there is one."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardspeed.checkpointing.hidden_states_offload import CheckpointHiddenStatesOffload


class HostAsDevice(CheckpointHiddenStatesOffload):
    """Offloads CPU tensors too (from one host buffer to another), so the whole path runs without a GPU."""

    def _skip(self, tensor):
        return tensor.nbytes < self.min_offload_bytes or isinstance(tensor, nn.Parameter)


def _blocks(layers: int = 4, width: int = 16) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))


def _forward(blocks, x, offload=None, hidden=None):
    h = x
    for block in blocks:
        if offload is not None:
            offload.mark(h)
        h = checkpoint(block, h, use_reentrant=False)
        if hidden is not None:
            hidden.append(weakref.ref(h))
    return h.square().sum()


def _grads(blocks, x):
    return [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]


@pytest.mark.parametrize("keep_last_count", [0, 1, 2])
def test_offloaded_hidden_states_leave_memory_and_give_equal_gradients(keep_last_count):
    blocks, x = _blocks(), torch.randn(8, 16, requires_grad=True)
    _forward(blocks, x).backward()
    expected = _grads(blocks, x)
    blocks.zero_grad(), x.grad.zero_()

    offload = HostAsDevice(use_streams=False, min_offload_bytes=0, keep_last_count=keep_last_count)
    hidden = []
    with offload:
        loss = _forward(blocks, x, offload, hidden)
        gc.collect()
        # Marks 0..3 are the inputs of layers 0..3: x, then the outputs of layers 0..2 (hidden[0..2]). The
        # oldest 4 - keep_last_count are offloaded, and an offloaded output is then held by nothing.
        offloaded = 4 - keep_last_count
        assert [ref() is not None for ref in hidden[:3]] == [mark >= offloaded for mark in (1, 2, 3)]
        loss.backward()
    for got, want in zip(_grads(blocks, x), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    stats = offload.stats
    assert (stats.marked_tensors, stats.offloaded_tensors, stats.restored_tensors) == (
        4,
        offloaded,
        offloaded,
    )
    assert stats.kept_last_tensors == keep_last_count and stats.skipped_marked_tensors == 0
    assert stats.offloaded_bytes == stats.restored_bytes == offloaded * 8 * 16 * 4


def test_host_buffers_are_pooled_and_small_or_unmarked_tensors_pass_through():
    blocks, x = _blocks(), torch.randn(8, 16, requires_grad=True)
    offload = HostAsDevice(
        use_streams=False, min_offload_bytes=0, keep_last_count=0, max_cpu_buffer_pool_count=8
    )
    for _ in range(2):
        with offload:
            _forward(blocks, x, offload).backward()
    assert offload._pooled == 4  # the second step reused the first step's four buffers
    tiny = HostAsDevice(use_streams=False, min_offload_bytes=10_000, keep_last_count=0)
    with tiny:
        _forward(blocks, x, tiny).backward()
    assert tiny.stats.offloaded_tensors == 0 and tiny.stats.skipped_marked_tensors == 4
    assert tiny.stats.saved_tensors_seen > 4


def test_cpu_tensors_are_not_offloaded_and_arguments_are_checked():
    blocks, x = _blocks(), torch.randn(8, 16, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with offload:
        _forward(blocks, x, offload).backward()
    assert offload.stats.skipped_marked_tensors == 4 and offload.stats.offloaded_tensors == 0
    with pytest.raises(ValueError, match="max_cpu_buffer_pool_count must be >= 0"):
        CheckpointHiddenStatesOffload(max_cpu_buffer_pool_count=-1)
    with offload, pytest.raises(RuntimeError, match="not re-entrant"):
        offload.__enter__()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_streams", [False, True])
def test_cuda_offload_frees_device_memory_and_gives_equal_gradients(use_streams):
    blocks, x = (
        _blocks(layers=6, width=1024).cuda(),
        torch.randn(2048, 1024, device="cuda", requires_grad=True),
    )
    _forward(blocks, x).backward()
    expected = _grads(blocks, x)
    blocks.zero_grad(), x.grad.zero_()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    loss = _forward(blocks, x)
    without = torch.cuda.memory_allocated() - baseline
    loss.backward()
    blocks.zero_grad(), x.grad.zero_()

    offload = CheckpointHiddenStatesOffload(use_streams=use_streams, keep_last_count=1, max_fwd_stash_count=0)
    with offload:
        loss = _forward(blocks, x, offload)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees blocks held by record_stream on its next call
        with_offload = torch.cuda.memory_allocated() - baseline
        loss.backward()
    torch.cuda.synchronize()
    for got, want in zip(_grads(blocks, x), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (
        offload.stats.offloaded_tensors == offload.stats.restored_tensors == 5
    )  # x stays: the test holds it
    layer_input = 2048 * 1024 * 4
    assert without - with_offload >= 4 * layer_input  # hidden[0..3] left the GPU (hidden[4] is kept last)
