"""Weights & Biases monitor (`pip install 'shardspeed[wandb]'`). Starts the run in the mode W&B's own
environment asks for (`WANDB_MODE`); where nothing is set and no API key is known it runs offline and
never tries to log in."""

from __future__ import annotations

import os

from shardspeed.monitor.base import Event, Monitor, missing_extra

__all__ = ["WandbMonitor"]


class WandbMonitor(Monitor):
    def __init__(self, block):
        try:
            import wandb
        except ImportError as err:
            raise missing_extra("wandb", "wandb", "wandb") from err
        # the block's settings under DeepSpeed's attribute names
        self.enabled, self.group, self.team, self.project = (
            block.enabled,
            block.group,
            block.team,
            block.project,
        )
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=block.project, group=block.group, entity=block.team, mode=mode)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()
