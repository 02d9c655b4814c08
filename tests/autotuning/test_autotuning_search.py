"""The autotuner's parts without training: the `autotuning` block, the search over micro-batch sizes,
stages, offload and ZeRO knobs, the results files, the engine's probe, the time bound and bad arguments.

The search tests replace the one method that launches a run (`ResourceManager.run`) with a stand-in that
"measures" a throughput from the experiment's config and fails above a micro-batch size, so each test checks
which experiments the autotuner chooses to run and which one it picks, in milliseconds. The real runs are in
test_autotuning_run.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from shardspeed.autotuning import Autotuner
from shardspeed.autotuning.experiments import Experiment, ResourceManager
from shardspeed.autotuning.search_order import GridSearchTuner, RandomTuner
from shardspeed.config import ConfigError, load_config
from shardspeed.launcher import runner
from shardspeed.runtime.autotuning_probe import AutotuningProbe

REPO = Path(__file__).resolve().parents[2]


# -- the config block -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"tuner_type": "model_based"}, 'autotuning.tuner_type: "model_based" is not supported'),
        ({"model_info": {"num_params": 10}}, "autotuning.model_info: is not supported"),
        ({"model_info_path": "x.json"}, "autotuning.model_info_path: is not supported"),
        (
            {"start_profile_step": 4, "end_profile_step": 2},
            "autotuning.end_profile_step: 2 is before autotuning.start_profile_step 4",
        ),
        ({"metric": "speed"}, "autotuning.metric: must be one of 'latency', 'throughput', 'flops'"),
        (
            {"tuner_typo": "random"},
            "unknown key 'autotuning.tuner_typo'; did you mean 'autotuning.tuner_type'",
        ),
        (
            {"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4},
            "autotuning.max_train_micro_batch_size_per_gpu: 4 is below",
        ),
        (
            {"arg_mappings": {"train_micro_batch_size_per_gpu": 3}},
            "autotuning.arg_mappings.train_micro_batch",
        ),
        ({"results_dir": ""}, "autotuning.results_dir: must not be empty"),
        ({"mp_size": 0}, "autotuning.mp_size: must be > 0"),
        ({"tuner_num_trials": True}, "autotuning.tuner_num_trials"),
    ],
)
def test_bad_autotuning_block_is_refused_naming_the_key(block, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {"enabled": True, **block}})
    assert message in str(err.value)


def test_good_autotuning_block_is_read():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {
        "enabled": True, "fast": False, "metric": "latency", "tuner_type": "random", "start_profile_step": 0,
        "end_profile_step": 0, "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"}}})  # fmt: skip
    block = cfg.autotuning
    assert (block.enabled, block.fast, block.metric, block.tuner_type) == (True, False, "latency", "random")
    assert block.arg_mappings == {"train_micro_batch_size_per_gpu": "--batch"}


# -- the search, with a stand-in for the runs --------------------------------------------------------------


def _tuner(tmp_path, monkeypatch, config: dict, resources=None, flags=(), fail_above=None, measure=None):
    """An Autotuner on `config` whose runs are simulated: throughput from `measure(ds_config)`, a failure
    for micro-batches above `fail_above`."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = runner.parse_args([*flags, "--autotuning", "tune", "train.py", "--deepspeed_config", str(path)])
    tuner = Autotuner(args, resources or {"localhost": [0]})
    measure = measure or (lambda c: c["train_micro_batch_size_per_gpu"] * 10.0)

    def run(exp: Experiment) -> Experiment:
        exp.result_dir = os.path.join(tuner.results_dir, exp.name)
        mbs = exp.ds_config["train_micro_batch_size_per_gpu"]
        if fail_above is not None and mbs > fail_above:
            exp.error = f"RuntimeError: out of memory at micro-batch {mbs}"
        else:
            throughput = measure(exp.ds_config)
            exp.metrics = {"throughput": throughput, "latency": 1000.0 / throughput}
        tuner.rm._write_json(os.path.join(tuner.exps_dir, f"{exp.name}.json"), exp.to_json())
        tuner.rm.finished.append(exp)
        return exp

    tuner.rm.run = run
    return tuner


def _names(tuner) -> list[str]:
    return [e.name for e in tuner.records]


def _best_by_records(tuner, metric="throughput"):
    ran = [e for e in tuner.records if e.error is None]
    pick = min if metric == "latency" else max
    return pick(ran, key=lambda e: e.metrics[metric])


def test_micro_batch_search_doubles_until_a_failure_then_refines(tmp_path, monkeypatch):
    tuner = _tuner(tmp_path, monkeypatch, {"autotuning": {"max_train_micro_batch_size_per_gpu": 64}},
                   fail_above=8)  # fmt: skip
    tuner.tune()
    # 1, 2, 4, 8 run; 16 fails (larger would too: nothing above it is tried); then DeepSpeed's refinement at
    # the global batch of 8: micro-batch 4 with 2 accumulation steps
    assert _names(tuner) == [
        "z0_gas1_tmbspg1", "z0_gas1_tmbspg2", "z0_gas1_tmbspg4", "z0_gas1_tmbspg8", "z0_gas1_tmbspg16",
        "z0_gas2_tmbspg4",
    ]  # fmt: skip
    assert tuner.records[4].error and "out of memory" in tuner.records[4].error
    assert tuner.best_experiment() is _best_by_records(tuner)


def test_micro_batch_search_stops_at_a_throughput_plateau(tmp_path, monkeypatch):
    flat = lambda c: 100.0 + c["train_micro_batch_size_per_gpu"]  # noqa: E731 - 3% per doubling
    config = {"train_micro_batch_size_per_gpu": 2, "autotuning": {"min_train_micro_batch_size_per_gpu": 3}}
    tuner = _tuner(tmp_path, monkeypatch, config, measure=flat)
    tuner.tune()
    # the user's micro-batch raised to the floor, one doubling, a gain under 5%: stop; then the refinement
    # at the largest size's global batch (6): micro-batch 3 with 2 accumulation steps
    assert _names(tuner) == ["z0_gas1_tmbspg3", "z0_gas1_tmbspg6", "z0_gas2_tmbspg3"]


def test_stages_and_offload_choices_are_spaces_in_order_and_the_best_is_picked(tmp_path, monkeypatch):
    def measure(c):  # stage 1 with CPU offload is the fastest here; bigger batches are faster
        zero = c["zero_optimization"]
        bonus = 5.0 if zero["stage"] == 1 and zero["offload_optimizer"]["device"] == "cpu" else 1.0
        return bonus * c["train_micro_batch_size_per_gpu"]

    config = {
        "train_micro_batch_size_per_gpu": [2, 4],
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
        "zero_optimization": {"stage": [1, 0], "offload_optimizer": {"device": ["none", "cpu"]}},
        "autotuning": {"results_dir": "res", "exps_dir": "exps"},
    }
    tuner = _tuner(tmp_path, monkeypatch, config, measure=measure)
    tuner.tune()
    spaces = list(dict.fromkeys(e.space for e in tuner.records))
    assert spaces == ["z0_oonone", "z1_oonone", "z1_oocpu"]  # stage 0 has no optimizer state to offload
    assert len(tuner.records) == 6
    best = tuner.best_experiment()
    assert best is _best_by_records(tuner) and best.name == "z1_oocpu_gas1_tmbspg4"
    assert best.ds_config["optimizer"]["params"]["betas"] == [0.9, 0.99]  # the optimizer's own list is kept
    tuner.write_optimal_config()
    tuner.print_tuning_results()
    assert sorted(p.stem for p in (tmp_path / "exps").glob("*.json")) == sorted(_names(tuner))
    results = tmp_path / "res"
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    assert optimal["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    assert optimal["train_batch_size"] == 4
    cmd = (results / "cmd_optimal.txt").read_text().split()
    assert cmd[cmd.index("--deepspeed_config") + 1] == str(results / "ds_config_optimal.json")
    summary = (results / "summary.txt").read_text()
    assert "| global " in summary and "z1_oocpu_gas1_tmbspg4" in summary and "experiments: 6." in summary


def test_latency_is_minimised(tmp_path, monkeypatch):
    config = {"train_micro_batch_size_per_gpu": [1, 2, 4], "autotuning": {"metric": "latency"}}
    tuner = _tuner(tmp_path, monkeypatch, config)
    tuner.tune()
    assert tuner.best_experiment() is _best_by_records(tuner, "latency")
    assert tuner.best_experiment().ds_config["train_micro_batch_size_per_gpu"] == 4  # 1000 / 40: lowest


def test_fast_false_tunes_the_stage_knobs_within_the_trial_budget(tmp_path, monkeypatch):
    config = {
        "train_micro_batch_size_per_gpu": [2],
        "zero_optimization": {"stage": 2, "reduce_bucket_size": [1e6, 2e6], "overlap_comm": False},
        "autotuning": {"fast": False, "tuner_num_trials": 3, "tuner_early_stopping": 10},
    }
    bucket = lambda c: c["zero_optimization"].get("reduce_bucket_size", 0) / 1e5 + 1  # noqa: E731
    tuner = _tuner(tmp_path, monkeypatch, config, measure=bucket)
    tuner.tune()
    knob_runs = tuner.records[1:]
    assert len(knob_runs) == 3  # tuner_num_trials bounds the knob space (2 x 2 x 3 x 3 x 2 = 72 configs)
    for exp in knob_runs:  # the user's value and list replace DeepSpeed's candidates
        assert exp.ds_config["zero_optimization"]["overlap_comm"] is False
        assert exp.ds_config["zero_optimization"]["reduce_bucket_size"] in (1e6, 2e6)
    assert tuner.best_experiment() is _best_by_records(tuner)


def test_max_and_min_train_batch_size_and_mp_size_set_the_batch_arithmetic(tmp_path, monkeypatch):
    config = {"autotuning": {"max_train_batch_size": 8, "min_train_batch_size": 4, "mp_size": 2,
                             "num_tuning_micro_batch_sizes": 2}}  # fmt: skip
    tuner = _tuner(tmp_path, monkeypatch, config, resources={"localhost": [0, 1]})
    tuner.tune()
    # 2 ranks / mp_size 2 = 1 data-parallel rank; max_train_batch_size 8 = 8 samples per rank per step
    for exp in tuner.records:
        c = exp.ds_config
        assert c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] == 8
        assert c["train_batch_size"] == 8
    assert (
        max(e.ds_config["train_micro_batch_size_per_gpu"] for e in tuner.records) == 8
    )  # capped by the budget


def test_min_train_batch_size_skips_smaller_global_batches(tmp_path, monkeypatch):
    config = {"train_micro_batch_size_per_gpu": [1, 2, 4], "autotuning": {"min_train_batch_size": 2}}
    tuner = _tuner(tmp_path, monkeypatch, config)
    tuner.tune()
    assert [e.ds_config["train_micro_batch_size_per_gpu"] for e in tuner.records] == [2, 4]


def test_tuners_order_and_early_stopping():
    class Runs:
        def __init__(self):
            self.order = []

        def run(self, exp):
            self.order.append(exp.name)
            exp.metrics = {"throughput": {"a": 5.0, "b": 1.0, "c": 1.0, "d": 9.0}[exp.name]}
            return exp

    def exps():
        return [Experiment(n, "z0", {}, 1, 1) for n in "abcd"]

    runs = Runs()
    grid = GridSearchTuner(exps(), runs, "throughput")
    assert grid.tune(n_trials=10, early_stopping=2) == 3  # a is best; b and c do not beat it: stop
    assert runs.order == ["a", "b", "c"] and grid.best_exp.name == "a"
    runs = Runs()
    assert GridSearchTuner(exps(), runs, "throughput").tune(n_trials=2) == 2
    runs = Runs()
    random_tuner = RandomTuner(exps(), runs, "throughput")
    random_tuner.tune(n_trials=10)
    assert sorted(runs.order) == ["a", "b", "c", "d"] and random_tuner.best_exp.name == "d"


def test_arg_mappings_write_the_experiment_values_into_the_script_arguments(tmp_path, monkeypatch):
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "autotuning": {"arg_mappings": {"train_micro_batch_size_per_gpu ": " --per_device_batch",
                                              "gradient_accumulation_steps": "--accum"}}}  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    args = runner.parse_args(["--autotuning", "tune", "train.py", "--deepspeed_config", "ds.json",
                              "--per_device_batch", "3", "--accum", "2"])  # fmt: skip
    tuner = Autotuner(args, {"localhost": [0]})
    assert tuner._start_mbs() == 3 and tuner._gas(3) == 2  # "auto": the script's own arguments
    script = tuner.rm.script_args(
        {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, "/x.json"
    )
    assert script == ["--deepspeed_config", "/x.json", "--per_device_batch", "8", "--accum", "4"]


def test_finished_experiment_is_reused_when_overwrite_is_false(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--autotuning", "tune", "missing.py", "--deepspeed_config", "ds.json"])
    rm = ResourceManager(args, ["localhost"], 1, "res", "exps", None, overwrite=False)
    os.makedirs("res/z0_gas1_tmbspg2")
    Path("res/z0_gas1_tmbspg2/metrics.json").write_text('{"throughput": 7.0}')
    exp = rm.run(Experiment("z0_gas1_tmbspg2", "z0", {"autotuning": {}}, 1, 1))
    assert exp.metrics == {"throughput": 7.0} and exp.error is None  # read back, not launched
    assert json.loads(Path("exps/z0_gas1_tmbspg2.json").read_text())["name"] == "z0_gas1_tmbspg2"


def test_an_experiment_past_its_time_limit_is_stopped_and_recorded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    script = tmp_path / "hang.py"
    script.write_text("import time\nwhile True:\n    time.sleep(1)\n")
    args = runner.parse_args(["--autotuning", "tune", str(script), "--deepspeed_config", "ds.json"])
    rm = ResourceManager(args, ["localhost"], 1, "res", "exps", None, timeout=3)
    exp = rm.run(Experiment("z0_gas1_tmbspg1", "z0", {"autotuning": {}}, 1, 1))
    assert exp.metrics is None and "time limit of 3 s" in exp.error
    cmd = (tmp_path / "res/z0_gas1_tmbspg1/cmd.txt").read_text().split()
    assert cmd[:4] == [sys.executable, "-u", "-m", "shardspeed.launcher.runner"]


# -- the engine's probe ----------------------------------------------------------------------------------


def test_probe_measures_the_profiled_steps_writes_the_metrics_and_ends_the_run(tmp_path):
    block = load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {
        "enabled": True, "start_profile_step": 1, "end_profile_step": 2,
        "metric_path": str(tmp_path / "m.json")}}).autotuning  # fmt: skip

    class Timers:
        cumulative = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    timers = Timers()
    probe = AutotuningProbe(block, timers=timers, rank=0, train_batch_size=8, gradient_accumulation_steps=1)
    for step, seconds in enumerate([5.0, 0.1, 0.3], start=1):  # step 0 (warm-up) is slow: not measured
        timers.cumulative["forward"] += seconds / 2
        timers.cumulative["backward"] += seconds / 2
        if step <= 2:
            probe.after_step(step)
    with pytest.raises(SystemExit) as done:
        probe.after_step(3)
    assert done.value.code == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["latency"] == pytest.approx(200.0)  # (0.1 + 0.3) / 2 s per step, in ms
    assert metrics["throughput"] == pytest.approx(8 / 0.2)
    assert metrics["measured_steps"] == 2


# -- bad command lines -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--autotuning", "tunes", "train.py"], "argument --autotuning: invalid choice: 'tunes'"),
        (["--autotuning"], "argument --autotuning: expected one argument"),
        (["--autotuning", "--num_gpus", "1", "train.py"], "argument --autotuning: expected one argument"),
    ],
)
def test_bad_autotuning_argument_exits_nonzero_naming_it(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        runner.main(argv)
    assert exit_.value.code != 0 and message in capsys.readouterr().err


def test_refused_autotuning_config_exits_nonzero_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"autotuning": {"tuner_type": "model_based"}}))
    code = runner.main(["--autotuning", "run", "train.py", "--deepspeed_config", "ds.json"])
    assert code == 2 and 'autotuning.tuner_type: "model_based" is not supported' in capsys.readouterr().err
