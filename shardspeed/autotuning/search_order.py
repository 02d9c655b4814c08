"""Search strategies over a list of experiments: DeepSpeed's `GridSearchTuner` and `RandomTuner`.

A tuner runs experiments in its order until `n_trials` have run or `early_stopping` experiments in a row
have not beaten the best one, and keeps the best. DeepSpeed's third strategy, `ModelBasedTuner` (an
XGBoost cost model that predicts which configs to try), is not built: `tuner_type: "model_based"` is
refused by the config block, and `deepspeed.autotuning.tuner.ModelBasedTuner` names itself when used.
"""

from __future__ import annotations

import random

from shardspeed.utils.logging import logger

from .experiments import Experiment, ResourceManager, better

__all__ = ["BaseTuner", "GridSearchTuner", "RandomTuner"]


class BaseTuner:
    """Runs `exps` through `resource_manager` in the order `next_batch` gives."""

    def __init__(self, exps: list[Experiment], resource_manager: ResourceManager, metric: str):
        self.all_exps = list(exps)
        self.rm = resource_manager
        self.metric = metric
        self.best_exp: Experiment | None = None
        self.best_metric_val: float | None = None
        self.best_iter = 0

    def has_next(self) -> bool:
        return bool(self.all_exps)

    def next_batch(self, sample_size: int) -> list[Experiment]:
        raise NotImplementedError

    def tune(self, sample_size: int = 1, n_trials: int = 1000, early_stopping: int | None = None) -> int:
        """Run experiments; returns how many ran."""
        ran = 0
        while ran < n_trials and self.has_next():
            for exp in self.next_batch(min(sample_size, n_trials - ran)):
                self.rm.run(exp)
                value = exp.value(self.metric)
                if better(self.metric, value, self.best_metric_val):
                    self.best_exp, self.best_metric_val, self.best_iter = exp, value, ran
                ran += 1
            if early_stopping and ran >= self.best_iter + 1 + early_stopping:
                logger.info(
                    f"autotuning: early stop after {ran} experiments, {early_stopping} without a better "
                    f"{self.metric} (best: experiment {self.best_iter + 1})"
                )
                break
        return ran


class GridSearchTuner(BaseTuner):
    """Experiments in the order given."""

    def next_batch(self, sample_size: int = 1) -> list[Experiment]:
        batch, self.all_exps = self.all_exps[:sample_size], self.all_exps[sample_size:]
        return batch


class RandomTuner(BaseTuner):
    """Experiments in a random order (not seeded, as DeepSpeed's)."""

    def next_batch(self, sample_size: int = 1) -> list[Experiment]:
        batch = random.sample(self.all_exps, min(sample_size, len(self.all_exps)))
        self.all_exps = [e for e in self.all_exps if e not in batch]
        return batch


TUNERS = {"gridsearch": GridSearchTuner, "random": RandomTuner}
