"""`disable_python_gc`: Python's automatic cyclic garbage collection off while an engine lives; `log_level`.

The collector pauses every thread at unpredictable moments to scan all container objects; with millions of
tensors' Python objects a pass can take long enough to stall one rank and, through the next collective,
all of them. With the key set, the first engine collects once and turns automatic collection off; it is
turned back on (if it was on) when the last such engine is destroyed. `engine.collect_python_gc()` collects
on demand (between steps, say). Process-wide, as DeepSpeed's: engines count, and a forked child starts
with the state its parent had before any engine.
"""

from __future__ import annotations

import gc
import os
import threading

from shardspeed.utils.logging import log_dist

__all__ = ["ProcessSettings", "PythonGC", "python_gc"]


class PythonGC:
    """Counts engines holding automatic collection off; restores the previous state when none is left."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    collected = gc.collect()
                    gc.disable()
                    log_dist(f"automatic Python garbage collection off (collected {collected} objects first)")
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                gc.enable()
                log_dist("automatic Python garbage collection restored")

    @property
    def holders(self) -> int:
        return self._holders

    @staticmethod
    def collect() -> int:
        """One full collection now, leaving the automatic setting as it is."""
        return gc.collect()

    def _after_fork_in_child(self) -> None:
        if self._holders and self._was_enabled:
            gc.enable()
        self._holders, self._was_enabled = 0, False
        self._lock = threading.Lock()


python_gc = PythonGC()


class ProcessSettings:
    """What an engine's config sets for the whole process: `log_level` (the library logger and its handlers,
    as DeepSpeed's) and `disable_python_gc` (held until `release()`, which `engine.destroy()` calls)."""

    def __init__(self, config):
        from shardspeed.utils.logging import logger

        if config.log_level is not None:
            level = config.log_level
            logger.setLevel(level)
            for handler in logger.handlers:
                handler.setLevel(level)
        self._holds_gc = config.disable_python_gc
        if self._holds_gc:
            python_gc.acquire()

    def release(self) -> None:
        if self._holds_gc:
            self._holds_gc = False
            python_gc.release()
