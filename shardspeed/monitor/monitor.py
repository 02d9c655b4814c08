"""`MonitorMaster`: the engine's one monitor, fanning events out to every enabled backend on global rank 0.

An event is `(name, value, step)`: DeepSpeed's names (`Train/Samples/train_loss`, ...) with the number of
samples seen as the step. Backends are built only when their block is enabled, so a run with every monitor
off imports nothing and writes nothing.
"""

from __future__ import annotations

from shardspeed.monitor.base import Event, Monitor, missing_extra

# Event, Monitor and missing_extra are base.py's, still importable here (their first home).
__all__ = ["Event", "Monitor", "MonitorMaster", "missing_extra"]


class MonitorMaster:
    """Every enabled monitor of a config (`tensorboard`, `csv_monitor`, `wandb`, `comet`), on rank 0 only.

    `enabled` is true when any backend is on (on every rank, as in DeepSpeed); only rank 0 builds and
    writes them.
    """

    def __init__(self, config, rank: int = 0):
        self.enabled = any(
            getattr(config, block).enabled for block in ("tensorboard", "csv_monitor", "wandb", "comet")
        )
        self.monitors: list[Monitor] = []
        if rank != 0 or not self.enabled:
            return
        if config.tensorboard.enabled:
            from shardspeed.monitor.tensorboard import TensorBoardMonitor

            self.monitors.append(TensorBoardMonitor(config.tensorboard))
        if config.csv_monitor.enabled:
            from shardspeed.monitor.csv_monitor import CsvMonitor

            self.monitors.append(CsvMonitor(config.csv_monitor))
        if config.wandb.enabled:
            from shardspeed.monitor.wandb import WandbMonitor

            self.monitors.append(WandbMonitor(config.wandb))
        if config.comet.enabled:
            from shardspeed.monitor.comet import CometMonitor

            self.monitors.append(CometMonitor(config.comet))

    def write_events(self, events: list[Event]) -> None:
        """Write `[(name, value, step), ...]` to every backend (a no-op off rank 0 or with none enabled)."""
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []
