"""DeepSpeed's accelerator interface (`deepspeed.accelerator.get_accelerator()`), over torch's device APIs.

Code written for DeepSpeed asks the accelerator object for device names, the communication backend, RNG and
memory statistics instead of calling `torch.cuda` directly (Transformers loads ZeRO-3 buffers onto
`get_accelerator().current_device_name()`). One class serves CUDA and CPU: each method asks torch about the
device type chosen once by `has_cuda` (device.py). Methods that only make sense on a GPU (streams,
events, memory statistics) do the CPU's equivalent: nothing, or zero.
"""

from __future__ import annotations

import contextlib
import os

import torch

from shardspeed.accelerator.native_pinning import get_active_native_pinned_memory
from shardspeed.accelerator.pinned_tracker import track_pinned_memory

__all__ = ["DeviceAccelerator", "chosen", "set_current"]

_chosen: list = []  # an accelerator object set_accelerator() installed, overriding the automatic choice


class DeviceAccelerator:
    """`get_accelerator()`'s object: `device_name()`, `communication_backend_name()`, `is_available()`, ..."""

    def __init__(self, device_type: str) -> None:
        self._name = device_type
        self._communication_backend_name = "nccl" if device_type == "cuda" else "gloo"
        self._cuda = device_type == "cuda"

    # -- identity --------------------------------------------------------------------------------------
    def device_name(self, device_index=None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"{self._name}:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def device(self, device_index=None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """GPUs visible; on CPU the ranks on this node (LOCAL_SIZE from DeepSpeed's launcher and ours,
        LOCAL_WORLD_SIZE from torchrun), as DeepSpeed's CPU accelerator counts one device per local rank."""
        if self._cuda:
            return torch.cuda.device_count()
        for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            value = os.environ.get(name, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        return not self._cuda  # CPU work is done when the call returns

    def use_host_timers(self) -> bool:
        return not self._cuda

    def resolves_data_dependency(self) -> bool:
        return not self._cuda

    def handles_memory_backpressure(self) -> bool:
        return not self._cuda

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True  # shardspeed's loss scaler runs fp16 on CPU too

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    def is_triton_supported(self) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- pinned host memory: torch's pinning, or the native backend (native_pinning.py) when
    # DS_PIN_MEMORY_BACKEND=native; both ask the environment on every call, as DeepSpeed's do. ---------------
    def pin_memory(
        self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True
    ) -> torch.Tensor:
        """`tensor` in page-locked host memory: a copy (`make_copy=False`: a fresh buffer of its size), in its
        shape or flat (`match_shape=False`). Counted by the pinned-memory tracker. Torch cannot page-lock on
        CPU, so there the torch backend returns `tensor` itself (a fresh buffer without `make_copy`), as
        DeepSpeed's CPU accelerator does, and counts nothing."""
        pins = get_active_native_pinned_memory()
        if pins is not None:
            track_pinned_memory(tensor.nbytes)
            return pins.pin(tensor, make_copy=make_copy, match_shape=match_shape)
        shape = tensor.shape if match_shape else (tensor.numel(),)
        if not self._cuda:
            return tensor if make_copy else tensor.new_empty(shape)
        track_pinned_memory(tensor.nbytes)
        if make_copy:
            return tensor.reshape(shape).pin_memory()
        return torch.empty(shape, dtype=tensor.dtype, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        pins = get_active_native_pinned_memory()
        if pins is not None and pins.is_pinned(tensor):
            return True
        return tensor.is_pinned() if self._cuda else False

    def unpin_memory(self, tensor: torch.Tensor):
        """Native backend: unlock the buffer and say whether it was one (True/False). Torch backend: None,
        nothing to do (torch frees page-locked memory with its tensor), as DeepSpeed's."""
        pins = get_active_native_pinned_memory()
        return pins.unpin(tensor) if pins is not None else None

    # -- synchronisation and streams ---------------------------------------------------------------------
    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def Stream(self, *args, **kwargs):  # DeepSpeed's name
        return torch.cuda.Stream(*args, **kwargs) if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._cuda and stream is not None else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def Event(self, **kwargs):  # DeepSpeed's name
        return torch.cuda.Event(**kwargs) if self._cuda else None

    # -- random numbers ---------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    # -- memory -----------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_max_memory_allocated(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else 0

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # -- autocast ---------------------------------------------------------------------------------------
    def amp(self):
        return torch.amp

    def get_autocast_context(self, dtype=None, enabled: bool = True):
        return torch.autocast(self._name, dtype=dtype, enabled=enabled)

    def __repr__(self) -> str:
        return f"DeviceAccelerator({self._name!r}, backend={self._communication_backend_name!r})"


def chosen() -> DeviceAccelerator | None:
    """The accelerator `set_current` installed, or None: then `get_accelerator()` picks CUDA or the CPU
    itself (shardspeed/accelerator/__init__.py, with the classes of cuda_accelerator.py and cpu_accelerator.py)."""
    return _chosen[0] if _chosen else None


def set_current(accelerator: DeviceAccelerator) -> None:
    """Use `accelerator` from now on (DeepSpeed's `set_accelerator`); only shardspeed's own kinds exist."""
    if not isinstance(accelerator, DeviceAccelerator):
        raise TypeError(
            f"set_accelerator: expected an accelerator from shardspeed.accelerator (cuda or cpu), got "
            f"{type(accelerator).__name__}; other device types are not supported"
        )
    _chosen[:] = [accelerator]
