"""A process-wide running total of host memory page-locked through the accelerator (DeepSpeed's
`deepspeed.utils.pin_memory_tracker`).

Page-locked memory cannot be swapped out and counts against the memlock limit (`ulimit -l`), so running out
of it shows up as a host out-of-memory far from the call that pinned the bytes. The tracker logs each pin at
DEBUG and an INFO line whenever the total crosses the next milestone: 32 GiB, then 64, 128, ... doubling, so
that a job pinning terabytes logs a handful of lines, not one per buffer.
"""

from __future__ import annotations

from shardspeed.utils.logging import logger

__all__ = ["PinnedMemoryTracker", "pinned_memory_summary", "track_pinned_memory"]

_GIB = 1024**3
_FIRST_MILESTONE = 32 * _GIB


def _fmt_bytes(num_bytes: int) -> str:
    """Bytes in the largest binary unit they reach: "512 B", "2.0 KB", "1.00 MB", "1.500 GB" (DeepSpeed's
    format, more digits for the larger units)."""
    for unit, size, digits in (("GB", _GIB, 3), ("MB", 1024**2, 2), ("KB", 1024, 1)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{digits}f} {unit}"
    return f"{num_bytes} B"


class PinnedMemoryTracker:
    """`_bytes` pinned so far in `_calls` allocations; `_next_checkpoint` the total that logs next.

    Only additions are counted, as DeepSpeed counts them: the total is what this process asked to pin, a
    ceiling on what is locked now (freed buffers are not subtracted)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = _FIRST_MILESTONE

    def track(self, num_bytes: int) -> None:
        self._bytes += int(num_bytes)
        self._calls += 1
        logger.debug(
            f"pin_memory: +{_fmt_bytes(num_bytes)} (call #{self._calls}, total {_fmt_bytes(self._bytes)})"
        )
        while self._bytes >= self._next_checkpoint:  # one call may cross several milestones: one line each
            logger.info(
                f"[pinned-memory checkpoint] crossed {_fmt_bytes(self._next_checkpoint)}: "
                f"{_fmt_bytes(self._bytes)} pinned across {self._calls} allocations"
            )
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        prefix = f"[pinned-memory {tag}]" if tag else "[pinned-memory]"
        logger.info(f"{prefix} {_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")


_tracker = PinnedMemoryTracker()  # DeepSpeed's name for the process-wide instance


def track_pinned_memory(num_bytes: int) -> None:
    """Add `num_bytes` just pinned to the process-wide total."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the process-wide total at INFO, prefixed with `tag`."""
    _tracker.log_summary(tag)
