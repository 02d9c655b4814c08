"""Offloading checkpointed hidden states to host memory between forward and backward (DeepSpeed's
`deepspeed.runtime.activation_checkpointing.offload_activations`).

With non-reentrant activation checkpointing each layer keeps only its input (the hidden states) for the
backward; on long sequences those inputs, one per layer, are most of what activation memory is left.
`CheckpointHiddenStatesOffload` is a `saved_tensors_hooks` context: a saved tensor that was *marked* as a
checkpointed input is copied to a host buffer when autograd saves it and copied back when the backward
unpacks it; every other saved tensor passes through untouched. While the context is open, Hugging Face's
`GradientCheckpointingLayer.__call__` marks its first argument (the hidden states) in training with
gradient checkpointing on, and the original `__call__` is put back when the last context closes.

What is offloaded: a marked tensor on the accelerator of at least `min_offload_bytes`, not a parameter or
buffer, not a view whose strides overlap (a stride-0 view cannot be rebuilt by a copy). On a device whose
work is synchronous (the CPU) nothing is offloaded: the tensor already lives in host memory, and the
marked tensor is counted as skipped. The newest `keep_last_count` marked tensors stay on the device,
since the backward needs them first. On CUDA with `use_streams`, copies run on a side stream overlapped
with compute; the device copies of the last `max_fwd_stash_count` offloaded tensors are held until the
backward, which uses them directly if they are still there (no copy back). Host buffers come from a pool
of at most `max_cpu_buffer_pool_count` buffers keyed by shape and dtype, page-locked through the
accelerator's `pin_memory` when `use_pin_memory`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

from shardspeed.accelerator import get_accelerator

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "patch_gradient_checkpointing_layer_marker",
]


@dataclass
class CheckpointActivationOffloadStats:
    """Counters of one context (DeepSpeed's field names)."""

    saved_tensors_seen: int = 0  # every tensor autograd saved while the context was open
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0  # marked, but not eligible (see the module docstring)
    kept_last_tensors: int = 0  # marked and eligible, but among the newest keep_last_count
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _Ticket:
    """What autograd holds instead of an offloaded tensor."""

    number: int


@dataclass
class _Offloaded:
    host: torch.Tensor
    device: torch.device
    size: torch.Size
    stride: tuple
    key: tuple
    stashed: torch.Tensor | None = None  # the device tensor, while still held (streams only)
    copied: object = None  # the side-stream event after which `host` is complete


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * tensor.nelement()


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """Offload marked checkpoint inputs to host memory while the context is open (see the module docstring)."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
                 keep_last_count: int = 1) -> None:  # fmt: skip
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):  # fmt: skip
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        accelerator = get_accelerator()
        # A synchronous device (the CPU) has no streams: copies would run inline, and nothing is offloaded there.
        self._side_stream = (
            accelerator.Stream() if use_streams and not accelerator.is_synchronized_device() else None
        )
        self.use_streams = self._side_stream is not None
        self._marks: dict[int, int] = {}  # id(tensor) -> marks not yet consumed by a save
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._pooled = 0
        self._open = False
        self.reset()
        super().__init__(self._pack, self._unpack)

    # -- marking -------------------------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        """Offload `tensor` the next time autograd saves it (a checkpointed layer's input)."""
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._marks.get(id(tensor), 0)
        if count == 0:
            return False
        if count == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = count - 1
        return True

    # -- the hooks -------------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        if self._skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return tensor
        self._number += 1
        self._newest[self._number] = tensor
        while len(self._newest) > self.keep_last_count:  # the oldest kept one leaves the device now
            number = next(iter(self._newest))
            self._offload(number, self._newest.pop(number))
        return _Ticket(self._number)

    def _unpack(self, saved):
        if not isinstance(saved, _Ticket):
            return saved
        # Unpacked more than once with retain_graph: the first restore is reused until the context closes.
        if saved.number in self._restored:
            return self._restored[saved.number]
        if saved.number in self._newest:
            self.stats.kept_last_tensors += 1
            tensor = self._newest.pop(saved.number)
        else:
            tensor = self._restore(saved.number)
        self._restored[saved.number] = tensor
        return tensor

    def _skip(self, tensor: torch.Tensor) -> bool:
        accelerator = get_accelerator()
        return (
            accelerator.is_synchronized_device()
            or not accelerator.on_accelerator(tensor)
            or _nbytes(tensor) < self.min_offload_bytes
            or isinstance(tensor, (torch.nn.Parameter, torch.nn.Buffer))
            or (tensor.numel() > 1 and 0 in tensor.stride())
        )

    # -- copies ----------------------------------------------------------------------------------------------
    def _stream(self):
        return torch.cuda.stream(self._side_stream) if self.use_streams else contextlib.nullcontext()

    def _offload(self, number: int, tensor: torch.Tensor) -> None:
        host, key = self._empty_cpu_like(tensor)
        entry = _Offloaded(host, tensor.device, tensor.size(), tensor.stride(), key)
        if self.use_streams:
            self._side_stream.wait_stream(torch.cuda.current_stream())  # the tensor is written by now
        with self._stream():
            host.copy_(tensor.detach(), non_blocking=self.use_streams)
        if self.use_streams:
            tensor.record_stream(self._side_stream)  # its memory is not reused before the copy is done
            entry.copied = self._side_stream.record_event()
            entry.stashed = tensor
            stashed = [n for n, e in self._offloaded.items() if e.stashed is not None]
            for old in stashed[: max(0, len(stashed) + 1 - self.max_fwd_stash_count)]:
                self._offloaded[old].stashed = None  # release the device copy of older ones
            if self.max_fwd_stash_count == 0:
                entry.stashed = None
        self._offloaded[number] = entry
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _nbytes(host)

    def _restore(self, number: int) -> torch.Tensor:
        entry = self._offloaded.pop(number, None)
        if entry is None:
            raise RuntimeError(
                f"offloaded activation {number} is gone: the backward must run inside the context"
            )
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(entry.host)
        if entry.stashed is not None:  # the device copy was still held: no copy back
            torch.cuda.current_stream().wait_event(entry.copied)
            self._give_back(entry.key, entry.host)
            return entry.stashed
        # A fresh tensor with the saved strides (a view's offset is not kept: the copy is dense).
        tensor = torch.empty_strided(entry.size, entry.stride, dtype=entry.host.dtype, device=entry.device)
        with self._stream():
            tensor.copy_(entry.host, non_blocking=self.use_streams)
        if self.use_streams:
            torch.cuda.current_stream().wait_stream(self._side_stream)
            tensor.record_stream(torch.cuda.current_stream())
        self._give_back(entry.key, entry.host)
        return tensor

    # -- host buffers ----------------------------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> tuple:
        """Host buffers are dense, so tensors differing only in strides share them."""
        return (tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory)

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """A dense host buffer of `tensor`'s shape and dtype (pooled, or new and pinned if `use_pin_memory`)."""
        key = self._buffer_key(tensor)
        if self._pool.get(key):
            self._pooled -= 1
            return self._pool[key].pop(), key
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            host = get_accelerator().pin_memory(host, make_copy=False)
        return host, key

    def _give_back(self, key: tuple, host: torch.Tensor) -> None:
        if self.use_streams:
            self._side_stream.synchronize()  # an in-flight copy back must finish before the buffer is reused
        if self._pooled < self.max_cpu_buffer_pool_count:
            self._pool.setdefault(key, []).append(host)
            self._pooled += 1

    # -- the context -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every offloaded tensor and zero the counters (the pool of host buffers is kept)."""
        if self.use_streams:
            self._side_stream.synchronize()
        self.stats = CheckpointActivationOffloadStats()
        self._number = 0
        self._newest: dict[int, torch.Tensor] = {}
        self._offloaded: dict[int, _Offloaded] = {}
        self._restored: dict[int, torch.Tensor] = {}
        self._marks.clear()

    def __enter__(self):
        if self._open:
            raise RuntimeError(
                "CheckpointHiddenStatesOffload is not re-entrant; use a separate instance for a nested context"
            )
        _marker.acquire()
        self._open = True
        self.reset()
        _active.stack = [*_managers(), self]
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            if self.use_streams:
                self._side_stream.synchronize()
            for entry in self._offloaded.values():  # never restored (no backward): their buffers go back
                self._give_back(entry.key, entry.host)
            stats = self.stats
            self.reset()
            self.stats = stats  # the counters stay readable after the context
        finally:
            self._open = False
            _active.stack = [m for m in _managers() if m is not self]
            _marker.release()
            super().__exit__(*exc_info)


def get_checkpoint_hidden_states_offloading_ctx_manager(**options) -> CheckpointHiddenStatesOffload:
    """DeepSpeed's factory: `CheckpointHiddenStatesOffload(**options)`."""
    return CheckpointHiddenStatesOffload(**options)


# -- the marker on Hugging Face's GradientCheckpointingLayer ----------------------------------------------------
_active = threading.local()  # .stack: the open contexts of this thread, innermost last


def _managers() -> list:
    return getattr(_active, "stack", [])


class _Marker:
    """Installs the marking `__call__` while at least one context is open, and puts the original back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._installed = None  # (class, the class's own __call__ or None, the wrapper)
        self._by_context = False  # installed by a context (undone when the last closes), not for good

    def acquire(self) -> None:
        with self._lock:
            if self._installed is None and importlib.util.find_spec("transformers") is not None:
                self._installed, self._by_context = _install(), True
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self._installed is None or not self._by_context:
                return
            layer_class, own_call, wrapper = self._installed
            self._installed = None
            if layer_class.__dict__.get("__call__") is not wrapper:
                return  # someone patched over us: leave theirs in place
            if own_call is None:
                del layer_class.__call__
            else:
                layer_class.__call__ = own_call


_marker = _Marker()


def _install():
    from transformers import GradientCheckpointingLayer

    own_call = GradientCheckpointingLayer.__dict__.get("__call__")  # None: inherited from nn.Module
    original = GradientCheckpointingLayer.__call__

    def marking_call(self, *args, **kwargs):
        managers = _managers()
        marked = None
        # Hugging Face checkpoints the first positional argument, the hidden states.
        hidden_states = args[0] if args else None
        checkpointing = (
            self.training and torch.is_grad_enabled() and getattr(self, "gradient_checkpointing", False)
        )
        if managers and checkpointing and torch.is_tensor(hidden_states):
            marked = hidden_states
            managers[-1].mark(marked)
        try:
            return original(self, *args, **kwargs)
        finally:
            if marked is not None:
                managers[-1]._consume_mark(marked)  # unsaved: drop the mark before id() is reused

    GradientCheckpointingLayer.__call__ = marking_call
    return GradientCheckpointingLayer, own_call, marking_call


def patch_gradient_checkpointing_layer_marker() -> None:
    """Install the marker for good, not only while a context is open; needs transformers."""
    if importlib.util.find_spec("transformers") is None:
        raise RuntimeError(
            "patch_gradient_checkpointing_layer_marker needs transformers (GradientCheckpointingLayer)"
        )
    with _marker._lock:
        if _marker._installed is None:
            _marker._installed = _install()
        _marker._by_context = False
