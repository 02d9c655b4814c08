"""When ZenFlow re-selects columns and when the offloaded optimizer catches up (`ZenFlowSchedule`).

Counted in ZenFlow steps (the engine's optimizer steps, one per gradient-accumulation window):

- the first `full_warm_up_rounds` steps are ordinary ZeRO-Offload steps (every column on the host);
- the columns are selected at the first step after warm-up and again every `select_interval` steps
  (`select_strategy` "step"), or every `select_interval` epochs ("epoch"; "auto" is one epoch). An epoch's
  length is `steps_per_epoch` when the config sets it, else the engine's training dataloader's length in
  optimizer steps; with neither the columns are selected once;
- the other columns are updated when `update_interval` steps have accumulated, and always before a
  re-selection (the accumulated gradient belongs to the columns it was gathered for). `update_interval`
  "auto" updates when the unselected columns have gathered as much gradient, per column, as a selected
  column receives in one step on average, in at least `auto_ratio` of the 2-D parameters (`AutoUpdate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardspeed.config import ConfigError
from shardspeed.config.zero import ZenFlowConfig

__all__ = ["AutoUpdate", "ZenFlowSchedule"]

_PATH = "zero_optimization.zenflow"


@dataclass
class AutoUpdate:
    """`update_interval: "auto"`: per 2-D parameter, the mean per-column gradient mass of the selected
    columns over the current window, against the per-column mass the unselected columns have accumulated."""

    auto_ratio: float
    window: int = 0
    selected_mean: dict[str, float] = field(default_factory=dict)
    unselected_total: dict[str, float] = field(default_factory=dict)

    def observe(self, name: str, selected_per_column: float, unselected_per_column: float) -> None:
        n = self.window + 1
        self.selected_mean[name] = (self.selected_mean.get(name, 0.0) * (n - 1) + selected_per_column) / n
        self.unselected_total[name] = self.unselected_total.get(name, 0.0) + unselected_per_column

    def end_step(self) -> None:
        self.window += 1

    def due(self) -> bool:
        """True when enough parameters' unselected columns have caught up with their selected ones."""
        if not self.selected_mean:
            return False
        ready = sum(self.unselected_total[n] >= self.selected_mean[n] for n in self.selected_mean)
        return ready >= max(1, int(self.auto_ratio * len(self.selected_mean)))

    def reset(self) -> None:
        self.window, self.selected_mean, self.unselected_total = 0, {}, {}

    def state_dict(self) -> dict:
        return {"window": self.window, "selected_mean": dict(self.selected_mean),
                "unselected_total": dict(self.unselected_total)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.window = state["window"]
        self.selected_mean = dict(state["selected_mean"])
        self.unselected_total = dict(state["unselected_total"])


@dataclass
class ZenFlowSchedule:
    """The step counters and the intervals they are compared with (0 = never re-select)."""

    warm_up_rounds: int
    select_every: int
    update_every: int | None  # None: "auto"
    auto: AutoUpdate | None = None
    steps: int = 0  # ZenFlow steps applied so far (warm-up included)
    accumulated: int = 0  # steps whose gradient waits for the host optimizer
    origin: int = -1  # the step selections are counted from: the end of the warm-up, or a restart

    def __post_init__(self) -> None:
        if self.origin < 0:
            self.origin = self.warm_up_rounds

    @classmethod
    def from_config(cls, config: ZenFlowConfig, loader_steps_per_epoch: int | None) -> ZenFlowSchedule:
        strategy, interval = config.select_strategy, config.select_interval
        if strategy == "auto":
            strategy, interval = "epoch", 1
        if strategy == "epoch":
            per_epoch = config.steps_per_epoch or loader_steps_per_epoch or 0
            interval = int(interval) * per_epoch
        update = None if config.update_interval == "auto" else int(config.update_interval)
        if update is not None and 0 < interval < update:
            raise ConfigError(
                f"{_PATH}.select_interval: re-selecting every {interval} steps is more often than "
                f"{_PATH}.update_interval ({update}); the selection must last at least one update interval"
            )
        auto = AutoUpdate(config.auto_ratio) if update is None else None
        return cls(
            warm_up_rounds=config.full_warm_up_rounds, select_every=interval, update_every=update, auto=auto
        )

    # -- where the current step stands ----------------------------------------------------------------------

    def in_warm_up(self) -> bool:
        return self.steps < self.warm_up_rounds

    def _selects_at(self, step: int) -> bool:
        since = step - self.origin
        return since == 0 or (since > 0 and self.select_every > 0 and since % self.select_every == 0)

    def selects_now(self) -> bool:
        """The columns are (re-)selected at this step."""
        return self._selects_at(self.steps)

    def updates_now(self) -> bool:
        """The host optimizer applies the accumulated gradient at the end of this step (counted in)."""
        if self._selects_at(self.steps + 1):
            return True  # flush before the next selection changes what the accumulation means
        if self.update_every is not None:
            return self.accumulated + 1 >= self.update_every
        return self.auto.due()

    def restart(self) -> None:
        """Select afresh at the next step (nothing accumulated), counting re-selections from there. What is
        left of the warm-up is skipped: the weights this follows (a load) are already trained."""
        self.origin, self.accumulated = max(self.steps, self.warm_up_rounds), 0
        self.steps = max(self.steps, self.warm_up_rounds)
        if self.auto is not None:
            self.auto.reset()

    def finish_step(self, updated: bool) -> None:
        self.steps += 1
        self.accumulated = 0 if updated else self.accumulated + 1
        if self.auto is not None:
            self.auto.reset() if updated else self.auto.end_step()

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "accumulated": self.accumulated,
            "origin": self.origin,
            "auto": self.auto.state_dict() if self.auto is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.accumulated = state["steps"], state["accumulated"]
        self.origin = state.get("origin", self.warm_up_rounds)
        if self.auto is not None and state.get("auto") is not None:
            self.auto.load_state_dict(state["auto"])
