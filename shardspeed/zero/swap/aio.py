"""Asynchronous file I/O for NVMe offload, without a compiled extension.

A pool of threads does positional reads and writes (`os.preadv` / `os.pwritev`) straight between a tensor's
memory and a file. Both calls release the GIL, so several requests are in the kernel at once while Python
keeps computing — the same overlap DeepSpeed gets from libaio, with no JIT build and no libaio-dev.

Each request is split into `block_size`-byte pieces. A piece whose memory address, file offset and length
are multiples of the page-aligned direct-I/O block goes through a file descriptor opened with `O_DIRECT`
(bypassing the page cache, so swapped state really leaves memory) where the filesystem accepts it; the rest
(a tail, an unaligned tensor, tmpfs which refuses `O_DIRECT`) goes through an ordinary descriptor. Tensors
allocated with `aligned_empty` are page aligned, so only the tail of a request is ever buffered.

How DeepSpeed's `aio` block maps here:

| key | here |
|---|---|
| `block_size` | bytes per piece (one `preadv`/`pwritev` call) |
| `queue_depth` x `intra_op_parallelism` (`thread_count`) | pieces in flight at once, as in DeepSpeed, where each of `intra_op_parallelism` threads keeps `queue_depth` requests in the kernel; the pool has that many threads (each piece is one blocking call) |
| `single_submit` | the pieces of one request are issued one after another, not all at once |
| `overlap_events` | false: every request is waited for before the call returns (synchronous I/O) |
| `use_gds` | no equivalent (GPUDirect Storage); a warning is logged by the config check, I/O goes via the host |
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = ["AioSettings", "AsyncFileIO", "IoRequest", "aligned_empty", "write_file"]

ALIGNMENT = 4096  # page size: what O_DIRECT needs of addresses, offsets and lengths on common filesystems


@dataclass(frozen=True)
class AioSettings:
    """The `aio` block's values (see the module docstring for what each one does here)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    @classmethod
    def from_config(cls, aio) -> AioSettings:
        if aio is None:
            return cls()
        return cls(
            block_size=int(aio.block_size),
            queue_depth=int(aio.queue_depth),
            thread_count=int(aio.intra_op_parallelism),
            single_submit=bool(aio.single_submit),
            overlap_events=bool(aio.overlap_events),
        )

    @property
    def in_flight(self) -> int:
        """Pieces in the kernel at once (and threads in the pool)."""
        return max(1, self.queue_depth) * max(1, self.thread_count)


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D tensor whose data starts on a page boundary (so O_DIRECT can move it).

    Pinned (page-locked) when asked and CUDA is present: host-to-device copies from it are asynchronous.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip : skip + nbytes].view(dtype)


def _memory(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no NumPy: ctypes over its data pointer)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"file I/O needs a contiguous CPU tensor, got {tensor.device} {tuple(tensor.shape)}")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class IoRequest:
    """One read or write in flight; `wait()` returns when every piece is done (and re-raises its error)."""

    def __init__(self, futures: list[Future], tensor: torch.Tensor, on_done=None, io=None):
        self._futures = futures
        self.tensor = tensor  # kept alive until the I/O has finished
        self._on_done = on_done
        self._io = io  # its `seconds_waiting` counts the time callers spent blocked here

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        for future in self._futures:
            future.result()
        if self._io is not None:
            self._io.seconds_waiting += time.perf_counter() - started
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()
        return self.tensor


class AsyncFileIO:
    """Reads tensors from and writes them to files, asynchronously, with a pool of threads."""

    def __init__(self, settings: AioSettings | None = None):
        self.settings = settings or AioSettings()
        self._pool = ThreadPoolExecutor(self.settings.in_flight, thread_name_prefix="shardspeed-aio")
        self._slots = threading.BoundedSemaphore(self.settings.in_flight)
        self.bytes_read = 0
        self.bytes_written = 0
        self.seconds_waiting = 0.0  # callers blocked in wait() or on a full queue
        # wall time with at least one piece in the kernel (disk throughput = bytes / this)
        self.seconds_busy = 0.0
        self._active = 0
        self._busy_since = 0.0
        self._busy_lock = threading.Lock()

    # -- public API -----------------------------------------------------------------------------------------

    def write(self, tensor: torch.Tensor, path: str) -> IoRequest:
        """Write `tensor`'s bytes to `path` (created or truncated to that size)."""
        self.bytes_written += tensor.numel() * tensor.element_size()
        return self._submit(tensor, path, writing=True)

    def read(self, tensor: torch.Tensor, path: str) -> IoRequest:
        """Fill `tensor` from `path` (which must hold at least its bytes)."""
        self.bytes_read += tensor.numel() * tensor.element_size()
        return self._submit(tensor, path, writing=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- pieces -------------------------------------------------------------------------------------------

    def _submit(self, tensor: torch.Tensor, path: str, writing: bool) -> IoRequest:
        view = _memory(tensor)
        nbytes = len(view)
        flags = os.O_WRONLY | os.O_CREAT if writing else os.O_RDONLY
        plain = os.open(path, flags, 0o600)
        if writing:
            os.ftruncate(plain, nbytes)
        direct = _open_direct(path, os.O_WRONLY if writing else os.O_RDONLY)
        block = max(ALIGNMENT, self.settings.block_size - self.settings.block_size % ALIGNMENT)
        address = tensor.data_ptr()
        pieces = [(start, min(start + block, nbytes)) for start in range(0, nbytes, block)]
        futures: list[Future] = []

        def run_piece(start: int, end: int) -> None:
            aligned = (address + start) % ALIGNMENT == 0 and (end - start) % ALIGNMENT == 0
            fd = direct if direct is not None and aligned else plain
            self._piece_started()
            try:
                try:
                    _transfer(fd, view[start:end], start, writing)
                except OSError as error:
                    if fd == plain or error.errno != errno.EINVAL:
                        raise
                    _transfer(plain, view[start:end], start, writing)  # O_DIRECT opened but refused
            finally:
                self._piece_finished()
                self._slots.release()

        if self.settings.single_submit:

            def run_all() -> None:
                for start, end in pieces:
                    self._slots.acquire()
                    run_piece(start, end)

            futures.append(self._pool.submit(run_all))
        else:
            for start, end in pieces:
                self._take_slot()
                futures.append(self._pool.submit(run_piece, start, end))

        def close_files() -> None:
            os.close(plain)
            if direct is not None:
                os.close(direct)

        request = IoRequest(futures, tensor, on_done=close_files, io=self)
        if not self.settings.overlap_events:
            request.wait()
        return request

    def _take_slot(self) -> None:
        """At most `in_flight` pieces in flight: a caller blocked here waits for the disk, and is counted so."""
        if not self._slots.acquire(blocking=False):
            started = time.perf_counter()
            self._slots.acquire()
            self.seconds_waiting += time.perf_counter() - started

    def _piece_started(self) -> None:
        with self._busy_lock:
            if self._active == 0:
                self._busy_since = time.perf_counter()
            self._active += 1

    def _piece_finished(self) -> None:
        with self._busy_lock:
            self._active -= 1
            if self._active == 0:
                self.seconds_busy += time.perf_counter() - self._busy_since


def _open_direct(path: str, flags: int) -> int | None:
    """A descriptor with O_DIRECT, or None where the platform or filesystem does not allow it (tmpfs)."""
    direct_flag = getattr(os, "O_DIRECT", 0)
    if not direct_flag:
        return None
    try:
        return os.open(path, flags | direct_flag)
    except OSError:
        return None


def _transfer(fd: int, buffer: memoryview, offset: int, writing: bool) -> None:
    """Move all of `buffer` at `offset`, looping over short reads/writes (preadv/pwritev may do part)."""
    done = 0
    while done < len(buffer):
        piece = buffer[done:]
        moved = os.pwritev(fd, [piece], offset + done) if writing else os.preadv(fd, [piece], offset + done)
        if moved <= 0:
            raise OSError(f"{'write' if writing else 'read'} of {len(piece)} bytes at offset {offset + done} "
                          f"moved nothing (file too short?)")  # fmt: skip
        done += moved


def write_file(tensor: torch.Tensor, path: str) -> None:
    """Write a contiguous CPU tensor's bytes to `path` now (no pool: small one-off writes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _transfer(fd, _memory(tensor), 0, writing=True)
    finally:
        os.close(fd)
