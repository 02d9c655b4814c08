"""Page-locked host buffers without torch's device runtime (DeepSpeed's `deepspeed.utils.pin_memory`, its
"native" pinning backend, chosen with `DS_PIN_MEMORY_BACKEND=native`).

torch pins host memory through the GPU runtime (`cudaHostAlloc`), so a CPU-only build cannot pin at all.
This backend locks pages with the operating system instead: each buffer is its own anonymous mapping
(page-aligned, so unlocking one buffer never unlocks a page another buffer shares) locked with `mlock`,
which is what DeepSpeed's compiled allocator does too; nothing here is compiled, the calls go through
ctypes. The locked bytes count against the memlock limit (`ulimit -l`); a buffer over it is refused with
that limit in the message, never silently left pageable.

The manager remembers each buffer's address range, so a view or slice of a pinned buffer (which loses the
`ds_pinned` mark) is still recognised. A buffer is unlocked when its last alias is garbage-collected, as
torch frees pinned memory, or earlier by `unpin`. Unlike DeepSpeed, `unpin` unlocks the pages and leaves the
memory valid until the tensor goes away: using a tensor after `unpin` reads pageable memory, not freed memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref

import torch

__all__ = ["NativePinnedMemory", "get_active_native_pinned_memory", "get_native_pinned_memory"]

BACKEND_VARIABLE = "DS_PIN_MEMORY_BACKEND"  # DeepSpeed's switch: "torch" (the default) or "native"
_BACKENDS = ("torch", "native")


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "mlock") or not hasattr(libc, "munlock"):
        return None
    for function in (libc.mlock, libc.munlock):
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        function.restype = ctypes.c_int
    return libc


def _is_storageless(tensor: torch.Tensor) -> bool:
    """Meta and fake tensors have no memory to look up; asking their data_ptr() warns or raises."""
    if tensor.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


class NativePinnedMemory:
    """Pins host tensors with mlock; `_ranges` maps each locked buffer's first address to its end."""

    def __init__(self) -> None:
        self._libc = _libc()
        if self._libc is None:
            # DeepSpeed fails here too when its allocator cannot be built: no silent torch fallback.
            raise RuntimeError(
                f"{BACKEND_VARIABLE}=native: pin_memory needs the C library's mlock/munlock, not found on this "
                "system; unset the variable to pin through torch"
            )
        self._page = mmap.PAGESIZE
        self._ranges: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}

    # -- pinning ----------------------------------------------------------------------------------------
    def pin(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """A page-locked copy of `tensor` (`make_copy=False`: same size, contents undefined), in its shape or
        flat (`match_shape=False`), marked `ds_pinned`."""
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(),)
        locked = self._new_locked(tensor.dtype, shape)
        if make_copy:
            locked.copy_(tensor.reshape(shape))
        return locked

    def pin_empty(self, example: torch.Tensor, shape) -> torch.Tensor:
        """A page-locked buffer of `shape` with `example`'s dtype (only the dtype is read)."""
        return self._new_locked(example.dtype, tuple(int(d) for d in shape))

    def _new_locked(self, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        length = max(self._page, -(-nbytes // self._page) * self._page)  # whole pages, at least one
        mapping = mmap.mmap(-1, length)
        # The tensor holds a reference to the mapping, so the memory lives as long as any alias of it.
        root = torch.frombuffer(mapping, dtype=torch.uint8, count=length)
        begin = root.data_ptr()
        if self._libc.mlock(ctypes.c_void_p(begin), ctypes.c_size_t(length)) != 0:
            error = ctypes.get_errno()
            raise RuntimeError(
                f"pin_memory: mlock of {nbytes} bytes failed ({os.strerror(error)}); the memlock limit "
                "(`ulimit -l`) caps page-locked memory per process"
            )
        self._ranges[begin] = begin + nbytes
        # Unlock when the mapping is released: the storage of every alias (views, slices) holds it, so this
        # runs only once the last of them is gone, as torch frees a pinned tensor's memory.
        self._finalizers[begin] = weakref.finalize(
            mapping, _unlock, self._libc, begin, length, self._ranges, self._finalizers
        )
        locked = root[:nbytes].view(dtype).view(shape)
        locked.ds_pinned = True
        locked.ds_pin_base = begin  # unpin() finds the buffer even after `.data` is pointed elsewhere
        return locked

    # -- queries and release ----------------------------------------------------------------------------
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (or the buffer it views) is a buffer this manager locked and has not unpinned."""
        if getattr(tensor, "ds_pinned", False):
            return True
        if _is_storageless(tensor) or tensor.device.type != "cpu":
            return False
        address = tensor.data_ptr()
        return any(begin <= address < end for begin, end in self._ranges.items())

    def unpin(self, tensor: torch.Tensor) -> bool:
        """Unlock the buffer `tensor` was pinned as; False if it is not one of this manager's."""
        begin = getattr(tensor, "ds_pin_base", None)
        if begin is None:
            begin = tensor.data_ptr()
        finalizer = self._finalizers.get(begin)
        if finalizer is None:
            return False
        finalizer()  # unlocks now and will not run again at collection
        if hasattr(tensor, "ds_pinned"):
            tensor.ds_pinned = False
        return True


def _unlock(libc, begin: int, length: int, ranges: dict, finalizers: dict) -> None:
    # At collection the pages may already be unmapped (which drops the lock): munlock's error is then moot.
    libc.munlock(ctypes.c_void_p(begin), ctypes.c_size_t(length))
    ranges.pop(begin, None)
    finalizers.pop(begin, None)


_shared_native_pins: NativePinnedMemory | None = None  # one manager per process: every caller sees all ranges


def get_native_pinned_memory() -> NativePinnedMemory:
    """The process-wide manager, built on first use."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def get_active_native_pinned_memory() -> NativePinnedMemory | None:
    """The manager when `DS_PIN_MEMORY_BACKEND=native`, None when it is "torch" or unset; another value is
    refused by name."""
    choice = os.environ.get(BACKEND_VARIABLE, "torch").strip().lower()
    if choice not in _BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE}={choice!r}: expected one of {', '.join(_BACKENDS)}")
    return get_native_pinned_memory() if choice == "native" else None
