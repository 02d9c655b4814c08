"""Comet monitor (`pip install comet_ml`): logs events every `samples_log_interval` samples."""

from __future__ import annotations

from shardspeed.monitor.base import Event, Monitor

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    def __init__(self, block):
        try:
            import comet_ml
        except ImportError as err:
            raise ImportError(
                "comet.enabled is true but the 'comet_ml' package is not installed; install it with: "
                "pip install comet_ml (or set comet.enabled to false)"
            ) from err
        self.interval = block.samples_log_interval
        self._last_logged: int | None = None
        self.experiment = comet_ml.start(
            api_key=block.api_key, project=block.project, workspace=block.workspace,
            experiment_key=block.experiment_key, mode=block.mode, online=block.online,
        )  # fmt: skip
        if block.experiment_name is not None:
            self.experiment.set_name(block.experiment_name)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            if (
                self._last_logged is None
                or step - self._last_logged >= self.interval
                or step == self._last_logged
            ):
                self.experiment.log_metric(name, value, step=step)
                self._last_logged = step

    def close(self) -> None:
        self.experiment.end()
