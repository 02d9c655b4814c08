"""`Autotuner`: `deepspeed --autotuning tune|run` — find the fastest config by running short trainings.

For each tuning space (ZeRO stage x offload choice, space.py), in DeepSpeed's order:

1. micro-batch sizes: the user's list as given; otherwise doubling from the user's micro-batch (or
   `min_train_micro_batch_size_per_gpu`) up to `max_train_micro_batch_size_per_gpu`, stopping at the first
   size that fails (out of memory: larger ones would too) or when throughput gains less than 5% (DeepSpeed's
   plateau rule). DeepSpeed instead estimates the largest size from the accelerator's free memory and the
   activation memory of a profiling run, which a CPU does not report; running the sizes measures instead.
   Then, as DeepSpeed, `num_tuning_micro_batch_sizes` sizes between half the largest that ran and it, at
   the largest one's global batch (more accumulation steps for smaller micro-batches).
2. with `fast: false` and stage > 0: DeepSpeed's ZeRO knobs for the stage (bucket sizes, overlap_comm, ...;
   user values and lists override) at the space's best micro-batch, by the configured tuner.

Every space is bounded by `tuner_num_trials` experiments and `tuner_early_stopping`. The best experiment
by `metric` (latency: lowest) is written as `ds_config_optimal.json` (its config without the `autotuning`
block) and `cmd_optimal.txt` (the launcher command that trains with it); `run` then runs that command.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import time

from shardspeed.config.build import BuildContext, build_block
from shardspeed.config.errors import ConfigError
from shardspeed.config.features import AutotuningConfig
from shardspeed.config.loader import load_config, read_config_source
from shardspeed.utils.logging import logger

from .constants import AUTOTUNING, METRIC_PERCENT_DIFF_CONST
from .dicts import get_val_by_key
from .experiments import Experiment, ResourceManager, better, config_arg_index
from .search_order import TUNERS
from .space import ExperimentConfigs, TuningSpace, spaces_of
from .summary import write_summary

__all__ = ["Autotuner", "AutotuningError"]


class AutotuningError(ValueError):
    """A problem with the autotuning input, reported before any experiment runs."""


class Autotuner:
    """DeepSpeed's `Autotuner(args, active_resources)`: `args` are the launcher's parsed flags,
    `active_resources` the hosts and slots it resolved ({"worker-0": [0, 1, 2, 3], ...})."""

    def __init__(self, args, active_resources: dict[str, list[int]]):
        self.args = args
        self.user_config = self._get_user_config(list(args.user_args))
        block = self.user_config.get(AUTOTUNING) or {}
        self.autotuning_config: AutotuningConfig = build_block(
            AutotuningConfig, block, AUTOTUNING, BuildContext()
        )
        cfg = self.autotuning_config
        self.exps_dir, self.results_dir = cfg.exps_dir, cfg.results_dir
        for folder in (self.exps_dir, self.results_dir):
            if cfg.overwrite and os.path.exists(folder):
                shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder, exist_ok=True)
        if not active_resources or not all(active_resources.values()):
            raise AutotuningError(f"no slots to run experiments on: {active_resources}")
        self.rm = ResourceManager(
            args, list(active_resources), min(len(s) for s in active_resources.values()), self.results_dir,
            self.exps_dir, cfg.arg_mappings, slots={h: sorted(s) for h, s in active_resources.items()},
            timeout=cfg.experiment_timeout, overwrite=cfg.overwrite,
        )  # fmt: skip
        self.exp_num_nodes, self.exp_num_gpus = self._get_exp_resources(args)
        if self.exp_num_gpus > self.rm.num_gpus_per_node or self.exp_num_nodes > len(self.rm.nodes):
            raise AutotuningError(
                f"experiments of {self.exp_num_nodes} node(s) x {self.exp_num_gpus} slot(s) do not fit the "
                f"resources {active_resources}"
            )
        self.configs = ExperimentConfigs(self.user_config, cfg, self.exp_num_gpus * self.exp_num_nodes)
        self.optimal_cmd: list[str] | None = None
        self.optimal_ds_config: dict | None = None
        self.start_time = time.time()

    # -- input ---------------------------------------------------------------------------------------------

    @staticmethod
    def _get_user_config(user_args: list[str]) -> dict:
        index = config_arg_index(user_args)
        if index < 0:
            raise AutotuningError(
                "--autotuning needs the script's config: pass --deepspeed_config ds_config.json to the script"
            )
        path = user_args[index]
        if not os.path.isfile(path):
            raise AutotuningError(f"--deepspeed_config {path}: no such file")
        try:
            return read_config_source(path)
        except ConfigError as err:
            raise AutotuningError(str(err)) from None

    def _get_exp_resources(self, args) -> tuple[int, int]:
        nodes = args.num_nodes if args.num_nodes > 0 else len(self.rm.nodes)
        gpus = args.num_gpus if args.num_gpus > 0 else self.rm.num_gpus_per_node
        return nodes, gpus

    def metric(self) -> str:
        return self.autotuning_config.metric

    def _check_inputs(self, spaces: list[TuningSpace]) -> None:
        """Refuse a config that no experiment could run before running any (the first space's config)."""
        cfg = self.autotuning_config
        first = self.configs.config(spaces[0], self._start_mbs(), self._gas(self._start_mbs()))
        try:
            load_config(first, world_size=self.exp_num_gpus * self.exp_num_nodes // cfg.mp_size)
        except ConfigError as err:
            raise AutotuningError(f"the config cannot run: {err}") from None
        for key in self.rm.arg_mappings:
            if get_val_by_key(first, key) is None:
                raise AutotuningError(
                    f"autotuning.arg_mappings: {key!r} is not a key of the experiments' config"
                )

    # -- batch arithmetic ----------------------------------------------------------------------------------

    def _user_value(self, key: str):
        """The user's value of a batch key: from the config, or (for "auto") from the mapped script argument."""
        value = self.user_config.get(key)
        arg = self.rm.arg_mappings.get(key)
        if value in (None, "auto") and arg and arg in self.args.user_args:
            text = self.args.user_args[self.args.user_args.index(arg) + 1]
            return int(text) if text.isdigit() else None
        return value if value != "auto" else None

    def _per_gpu_budget(self) -> int | None:
        """Samples per rank per step when max_train_batch_size fixes the global batch (DeepSpeed's rule)."""
        cfg = self.autotuning_config
        if not cfg.max_train_batch_size:
            return None
        return max(1, cfg.max_train_batch_size * cfg.mp_size // (self.exp_num_gpus * self.exp_num_nodes))

    def _gas(self, mbs: int) -> int:
        budget = self._per_gpu_budget()
        if budget is not None:
            return max(1, budget // mbs)
        gas = self._user_value("gradient_accumulation_steps")
        return gas if isinstance(gas, int) and gas > 0 else 1

    def _max_mbs(self) -> int:
        cfg = self.autotuning_config
        budget = self._per_gpu_budget()
        return (
            min(cfg.max_train_micro_batch_size_per_gpu, budget)
            if budget
            else cfg.max_train_micro_batch_size_per_gpu
        )

    def _start_mbs(self) -> int:
        mbs = self._user_value("train_micro_batch_size_per_gpu")
        if isinstance(mbs, list):
            mbs = min(mbs)
        floor = self.autotuning_config.min_train_micro_batch_size_per_gpu
        return max(mbs, floor) if isinstance(mbs, int) and not isinstance(mbs, bool) else floor

    # -- the search ----------------------------------------------------------------------------------------

    def _run(self, space: TuningSpace, mbs: int, gas: int, knobs: dict | None = None, name_knobs=None):
        name = self.configs.name(space, mbs, gas, name_knobs)
        done = next((e for e in self.rm.finished if e.name == name), None)
        if done is not None:
            return done
        config = self.configs.config(space, mbs, gas, knobs)
        exp = Experiment(name, space.name, config, self.exp_num_gpus, self.exp_num_nodes)
        if config["train_batch_size"] < self.autotuning_config.min_train_batch_size:
            exp.error = (
                f"train_batch_size {config['train_batch_size']} is below autotuning.min_train_batch_size"
            )
            return exp
        logger.info(f"autotuning: running {name}")
        self.rm.run(exp)
        outcome = (
            f"{self.metric()} = {exp.value(self.metric())}" if exp.error is None else f"failed: {exp.error}"
        )
        logger.info(f"autotuning: {name}: {outcome}")
        return exp

    def tune(self) -> None:
        """Run the experiments of every tuning space (see the module's docstring)."""
        self.start_time = time.time()
        try:
            spaces = spaces_of(self.user_config)
        except ValueError as err:
            raise AutotuningError(str(err)) from None
        self._check_inputs(spaces)
        for space in spaces:
            best = self.tune_micro_batch_sizes(space)
            if best is not None and not self.autotuning_config.fast and space.stage > 0:
                self.tune_knobs(space, best)

    def tune_micro_batch_sizes(self, space: TuningSpace) -> Experiment | None:
        cfg = self.autotuning_config
        user_sizes = self.user_config.get("train_micro_batch_size_per_gpu")
        trials = 0
        if isinstance(user_sizes, list):  # the user's sizes, in the tuner's order
            sizes = sorted(
                {s for s in user_sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0}
            )
            exps = [self._experiment_spec(space, s, self._gas(s)) for s in sizes]
            tuner = TUNERS[cfg.tuner_type](exps, _Runner(self), self.metric())
            tuner.tune(n_trials=cfg.tuner_num_trials, early_stopping=cfg.tuner_early_stopping)
            return self._best_of(space.name)
        largest_ok, previous, mbs = None, None, self._start_mbs()
        since_best, best = 0, None
        while mbs <= self._max_mbs() and trials < cfg.tuner_num_trials:
            exp = self._run(space, mbs, self._gas(mbs))
            trials += 1
            if exp.error is not None:
                break  # out of memory (or worse): a larger micro-batch fails too
            largest_ok = mbs
            throughput = exp.value("throughput")
            if better(self.metric(), exp.value(self.metric()), best):
                best, since_best = exp.value(self.metric()), 0
            else:
                since_best += 1
            plateau = previous is not None and throughput < previous * (1 + METRIC_PERCENT_DIFF_CONST)
            if plateau or since_best >= cfg.tuner_early_stopping:
                break
            previous, mbs = throughput, mbs * 2
        if largest_ok is not None:
            for size in self._refined_sizes(largest_ok)[: max(0, cfg.tuner_num_trials - trials)]:
                self._run(space, size, self._refined_gas(largest_ok, size))
        return self._best_of(space.name)

    def _refined_sizes(self, largest: int) -> list[int]:
        """DeepSpeed's list: sizes from half the largest up to it that need more accumulation steps at the
        largest size's global batch, `num_tuning_micro_batch_sizes` strides apart."""
        cfg = self.autotuning_config
        low = max(cfg.min_train_micro_batch_size_per_gpu, largest // 2)
        stride = max(1, (largest - low) // cfg.num_tuning_micro_batch_sizes)
        budget = largest * self._gas(largest)
        return [s for s in range(low, largest, stride) if budget // s != budget // largest]

    def _refined_gas(self, largest: int, size: int) -> int:
        return max(1, largest * self._gas(largest) // size)

    def tune_knobs(self, space: TuningSpace, best: Experiment) -> None:
        cfg = self.autotuning_config
        keys, combinations = self.configs.knob_choices(space.stage)
        mbs = best.ds_config["train_micro_batch_size_per_gpu"]
        gas = best.ds_config["gradient_accumulation_steps"]
        exps = [self._experiment_spec(space, mbs, gas, c, {k: c[k] for k in keys}) for c in combinations]
        tuner = TUNERS[cfg.tuner_type](exps, _Runner(self), self.metric())
        tuner.tune(n_trials=cfg.tuner_num_trials, early_stopping=cfg.tuner_early_stopping)

    def _experiment_spec(self, space, mbs, gas, knobs=None, name_knobs=None) -> Experiment:
        """An experiment not yet run; _Runner runs it through _run (which skips one already run)."""
        name = self.configs.name(space, mbs, gas, name_knobs)
        return Experiment(name, space.name, {}, 0, 0, plan=(space, mbs, gas, knobs, name_knobs))

    # -- results -------------------------------------------------------------------------------------------

    @property
    def records(self) -> list[Experiment]:
        return list(self.rm.finished)

    def _best_of(self, space_name: str | None) -> Experiment | None:
        best = None
        for exp in self.rm.finished:
            if (space_name is None or exp.space == space_name) and better(
                self.metric(), exp.value(self.metric()), best.value(self.metric()) if best else None
            ):
                best = exp
        return best

    def best_experiment(self) -> Experiment | None:
        """The best experiment of the whole search by `metric`; None if none ran successfully."""
        return self._best_of(None)

    def print_tuning_results(self) -> None:
        """Print and write `summary.txt`: per space the experiments run and the best one, then the best overall."""
        duration = datetime.timedelta(seconds=round(time.time() - self.start_time))
        text = write_summary(self.results_dir, self.rm.finished, self.metric(), self._best_of, duration)
        print(text)

    def write_optimal_config(self) -> None:
        """`ds_config_optimal.json` and `cmd_optimal.txt` in results_dir, from the best experiment."""
        best = self.best_experiment()
        if best is None:
            logger.info("autotuning: no experiment ran successfully; no optimal config written")
            return
        config = json.loads(json.dumps(best.ds_config))
        config.pop(AUTOTUNING, None)  # the optimal run trains; it is not an experiment
        path = os.path.abspath(os.path.join(self.results_dir, "ds_config_optimal.json"))
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)
        cmd = [*self.rm.launcher_command(best.num_gpus, best.num_nodes), self.args.user_script,
               *self.rm.script_args(config, path)]  # fmt: skip
        with open(os.path.join(self.results_dir, "cmd_optimal.txt"), "w", encoding="utf-8") as handle:
            handle.write(" ".join(cmd) + "\n")
        self.optimal_cmd, self.optimal_ds_config = cmd, config
        logger.info(f"autotuning: {best.name} is the optimal setup; wrote {path} and cmd_optimal.txt")

    def run_after_tuning(self) -> int:
        """Train with the optimal config (`--autotuning run`); the training's exit code."""
        if not self.optimal_cmd:
            logger.info("autotuning: no optimal config found; nothing to run")
            return 1
        process = subprocess.Popen(self.optimal_cmd)
        try:
            return process.wait()
        except BaseException:  # SIGTERM of the autotuner: the training must not outlive it
            process.terminate()
            process.wait()
            raise


class _Runner:
    """The tuners' view of the autotuner: `run(exp)` runs a planned experiment (once) and fills it in."""

    def __init__(self, tuner: Autotuner):
        self.tuner = tuner

    def run(self, exp: Experiment) -> Experiment:
        done = self.tuner._run(*exp.plan)
        exp.ds_config, exp.metrics, exp.error, exp.result_dir = (
            done.ds_config,
            done.metrics,
            done.error,
            done.result_dir,
        )
        return exp
