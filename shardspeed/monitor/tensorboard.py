"""TensorBoard monitor: event files under `output_path/job_name/`, written by torch's SummaryWriter
(needs the `tensorboard` package: `pip install 'shardspeed[tensorboard]'`)."""

from __future__ import annotations

import os

from shardspeed.monitor.base import Event, Monitor, missing_extra

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(Monitor):
    def __init__(self, block):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise missing_extra("tensorboard", "tensorboard", "tensorboard") from err
        # the block's settings under DeepSpeed's attribute names (code reads monitor.enabled, .job_name)
        self.enabled, self.output_path, self.job_name = block.enabled, block.output_path, block.job_name
        self.log_dir = os.path.join(block.output_path or ".", block.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
