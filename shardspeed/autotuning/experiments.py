"""Running autotuning experiments: one candidate config, one short training run of the user's script.

`ResourceManager` (DeepSpeed's name; `deepspeed.autotuning.scheduler` resolves here) writes the experiment
where DeepSpeed writes it (`<exps_dir>/<name>.json`; `<results_dir>/<name>/` with `ds_config.json`,
`exp.json`, `cmd.txt`, `stdout.log`, `stderr.log` and the engine's `metrics.json`), starts the script through
shardspeed's own launcher (`python -m shardspeed.launcher.runner`) with the config path swapped for the
experiment's, and waits for it.

Experiments run one at a time. DeepSpeed runs several at once when they fit on disjoint GPUs; here a
measurement never shares the machine with another experiment, which is what makes the numbers comparable
(on a CPU, two runs at once would each slow the other down). Every run is time-bounded
(`autotuning.experiment_timeout`): a run still going then is stopped (its whole process group) and
recorded as failed. A failed run (an exception, out of memory, a script that ends before the profiled
steps) is recorded with the error line from its stderr and skipped; the search goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from .constants import AUTOTUNING, AUTOTUNING_METRIC_PATH, DS_CONFIG
from .dicts import get_val_by_key

__all__ = ["CONFIG_FLAGS", "Experiment", "ResourceManager", "better", "config_arg_index"]

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")  # where a script takes its config (HF: --deepspeed)
STOP_GRACE_SECONDS = 20  # after SIGTERM, before SIGKILL, for a timed-out experiment


@dataclasses.dataclass
class Experiment:
    """One candidate config and, once run, what it measured or why it failed."""

    name: str
    space: str  # the tuning space it belongs to (z0, z1_oocpu, ...)
    ds_config: dict[str, Any]
    num_gpus: int
    num_nodes: int
    exp_id: int = -1
    result_dir: str = ""
    metrics: dict[str, float] | None = None
    error: str | None = None
    plan: tuple | None = None  # for a tuner's experiment not yet run: what the autotuner runs for it

    def value(self, metric: str) -> float | None:
        """The measured `metric`, or None when the run failed."""
        return None if self.metrics is None else self.metrics.get(metric)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            DS_CONFIG: self.ds_config,
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
        }


def better(metric: str, value: float | None, than: float | None) -> bool:
    """Whether `value` beats `than` (latency: lower; throughput and flops: higher). DeepSpeed 0.19.8 takes
    the highest value of every metric, so there the slowest config wins a latency search."""
    if value is None:
        return False
    if than is None:
        return True
    return value < than if metric == "latency" else value > than


def config_arg_index(user_args: list[str]) -> int:
    """Index in `user_args` of the config path after --deepspeed_config (or --deepspeed); -1 if absent."""
    for flag in CONFIG_FLAGS:
        if flag in user_args:
            index = user_args.index(flag) + 1
            if index < len(user_args):
                return index
    return -1


class ResourceManager:
    """Runs experiments on the hosts and slots the launcher resolved, one at a time (DeepSpeed's name)."""

    def __init__(self, args, hosts, num_gpus_per_node: int, results_dir, exps_dir, arg_mappings,
                 *, slots: dict[str, list[int]] | None = None, timeout: float = 1800.0,
                 overwrite: bool = True):  # fmt: skip
        self.args = args
        if isinstance(hosts, str):  # DeepSpeed's tests give "worker-0, worker-1"
            hosts = [h.strip() for h in hosts.split(",") if h.strip()]
        self.nodes = list(hosts)
        self.num_gpus_per_node = num_gpus_per_node
        self.slots = slots or {host: list(range(num_gpus_per_node)) for host in self.nodes}
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.timeout = timeout
        self.overwrite = overwrite
        self.experiment_count = 0
        # script argument per config key; surrounding spaces are not part of either name (as DeepSpeed)
        self.arg_mappings = {k.strip(): v.strip() for k, v in (arg_mappings or {}).items()}
        self.finished: list[Experiment] = []

    # -- one experiment ------------------------------------------------------------------------------------

    def run(self, exp: Experiment) -> Experiment:
        """Run `exp` to its end (or its time limit) and record the outcome on it."""
        exp.exp_id = self.experiment_count
        self.experiment_count += 1
        exp.result_dir = os.path.join(self.results_dir, exp.name)
        metric_file = os.path.join(exp.result_dir, "metrics.json")
        exp.ds_config.setdefault(AUTOTUNING, {})[AUTOTUNING_METRIC_PATH] = os.path.abspath(metric_file)
        self._write_json(os.path.join(self.exps_dir, f"{exp.name}.json"), exp.to_json())
        if not self.overwrite and os.path.isfile(metric_file):  # a finished run of an earlier search
            exp.metrics = self._read_metrics(metric_file)
            self.finished.append(exp)
            return exp
        os.makedirs(exp.result_dir, exist_ok=True)
        if os.path.exists(metric_file):
            os.remove(metric_file)
        config_path = os.path.abspath(os.path.join(exp.result_dir, "ds_config.json"))
        self._write_json(config_path, exp.ds_config)
        cmd = self.command(exp, config_path)
        with open(os.path.join(exp.result_dir, "cmd.txt"), "w", encoding="utf-8") as handle:
            handle.write(" ".join(cmd) + "\n")
        self._write_json(os.path.join(exp.result_dir, "exp.json"), {**exp.to_json(), "exp_id": exp.exp_id,
                                                                    "result_dir": exp.result_dir, "cmd": cmd})  # fmt: skip
        returncode = self._launch(cmd, exp.result_dir)
        if returncode is None:
            exp.error = f"stopped after the time limit of {self.timeout:g} s (autotuning.experiment_timeout)"
        elif returncode != 0:
            exp.error = _error_line(os.path.join(exp.result_dir, "stderr.log")) or f"exit code {returncode}"
        elif not os.path.isfile(metric_file):
            exp.error = (
                "the script ended before the profiled steps were done (no metrics written): it must run at "
                "least end_profile_step + 1 optimizer steps"
            )
        else:
            exp.metrics = self._read_metrics(metric_file)
        self.finished.append(exp)
        return exp

    def command(self, exp: Experiment, config_path: str) -> list[str]:
        """The launcher command of one run: the user's script and arguments, the config swapped for
        `config_path`, the values of `arg_mappings` written in."""
        return [*self.launcher_command(exp.num_gpus, exp.num_nodes, exp.exp_id), self.args.user_script,
                *self.script_args(exp.ds_config, config_path)]  # fmt: skip

    def launcher_command(self, num_gpus: int, num_nodes: int, exp_id: int = 0) -> list[str]:
        """shardspeed's launcher on the first `num_nodes` hosts, `num_gpus` slots each."""
        args = self.args
        hosts = self.nodes[:num_nodes]
        cmd = [sys.executable, "-u", "-m", "shardspeed.launcher.runner"]
        chosen = {host: self.slots[host][:num_gpus] for host in hosts}
        if getattr(args, "hostfile", None):
            include = "@".join(f"{host}:{','.join(map(str, s))}" for host, s in chosen.items())
            cmd += ["--hostfile", args.hostfile, "--include", include]
        elif chosen[hosts[0]] == list(range(num_gpus)):
            cmd += ["--num_gpus", str(num_gpus)]
        else:
            cmd += ["--include", f"{hosts[0]}:{','.join(map(str, chosen[hosts[0]]))}"]
        cmd += ["--master_port", str(getattr(args, "master_port", 29500) + exp_id)]
        for flag in ("module", "no_python", "no_local_rank", "bind_cores_to_rank"):
            if getattr(args, flag, False):
                cmd.append(f"--{flag}")
        return cmd

    def script_args(self, ds_config: dict, config_path: str) -> list[str]:
        user_args = list(self.args.user_args)
        index = config_arg_index(user_args)
        if index < 0:
            raise ValueError("the script's arguments name no config: give --deepspeed_config ds_config.json")
        user_args[index] = config_path
        for key, arg in self.arg_mappings.items():
            value = get_val_by_key(ds_config, key)
            if value is None or str(value) == "auto":
                continue
            if arg in user_args and user_args.index(arg) + 1 < len(user_args):
                user_args[user_args.index(arg) + 1] = str(value)
            else:
                user_args += [arg, str(value)]
        return user_args

    def _launch(self, cmd: list[str], result_dir: str) -> int | None:
        """Run `cmd` with its output in result_dir; its exit code, or None when the time limit stopped it."""
        with (
            open(os.path.join(result_dir, "stdout.log"), "wb") as out,
            open(os.path.join(result_dir, "stderr.log"), "wb") as err,
        ):
            # its own session, so that a timed-out run is stopped with every rank it started
            process = subprocess.Popen(
                cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True
            )
            try:
                return process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _stop_group(process)
                return None
            except BaseException:  # Ctrl-C or SIGTERM of the autotuner: its own session would outlive it
                _stop_group(process)
                raise

    @staticmethod
    def _write_json(path: str, value: Any) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(value, handle, indent=2)

    @staticmethod
    def _read_metrics(path: str) -> dict[str, float]:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the experiment's process group (the launcher forwards it to the ranks), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.poll() is not None:
            break
    process.wait()


def _error_line(stderr_path: str) -> str | None:
    """The last line of the run's stderr that names an error (the exception line of a traceback)."""
    try:
        with open(stderr_path, encoding="utf-8", errors="replace") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Killed" in line:
            return line[:500]
    return lines[-1][:500] if lines else None
