"""Wall-clock timers for `wall_clock_breakdown` (throughput: `throughput.py`)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from shardspeed import accelerator


class PhaseTimers:
    """Accumulates time spent in forward/backward/step between two reports.

    Timing synchronises the device first (CUDA kernels are asynchronous), which costs throughput, so the
    engine only times phases when `wall_clock_breakdown` is on.
    """

    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)  # since the last report()
        self.window: dict[str, float] = defaultdict(float)  # since the last take_window() (the monitors')
        self.last: dict[str, float] = {}  # the latest interval of each phase
        self.cumulative: dict[str, float] = defaultdict(
            float
        )  # since construction, never cleared (autotuning)
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            accelerator.synchronize(self.device)
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._started:
            accelerator.synchronize(self.device)
            elapsed = time.perf_counter() - self._started.pop(name)
            self.totals[name] += elapsed
            self.window[name] += elapsed
            self.cumulative[name] += elapsed
            self.last[name] = elapsed

    def report(self) -> str:
        text = " | ".join(f"{name}: {1000 * total:.1f} ms" for name, total in self.totals.items())
        self.totals.clear()
        return text

    def take_window(self) -> dict[str, float]:
        """Seconds per phase since the previous call, then start a new window."""
        window = dict(self.window)
        self.window.clear()
        return window
