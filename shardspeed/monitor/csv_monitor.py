"""CSV monitor: one file per event, `output_path/job_name/<name with '/' as '_'>.csv`, header `step,<last
part of the name>`, as DeepSpeed writes them. Standard library only."""

from __future__ import annotations

import csv
import os

from shardspeed.monitor.base import Event, Monitor

__all__ = ["CsvMonitor", "csv_path"]


def csv_path(log_dir: str, name: str) -> str:
    return os.path.join(log_dir, name.replace("/", "_") + ".csv")


class CsvMonitor(Monitor):
    def __init__(self, block):
        # the block's settings under DeepSpeed's attribute names (code reads monitor.enabled, .job_name)
        self.enabled, self.output_path, self.job_name = block.enabled, block.output_path, block.job_name
        self.log_dir = os.path.join(block.output_path or ".", block.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._started: set[str] = set()

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            path = csv_path(self.log_dir, name)
            new = name not in self._started
            with open(path, "w" if new else "a", newline="") as f:  # a new run starts each file afresh
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                    self._started.add(name)
                writer.writerow([step, float(value)])

    def close(self) -> None:
        pass
