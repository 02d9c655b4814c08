"""`deepspeed --autotuning run` end to end on CPU: real short trainings of a script, then training with the best;
and the engines' half on its own (the data-parallel and the pipeline engine measure and end the run).

Two ZeRO stages x two micro-batch sizes, one rank, two profiled steps each. The larger micro-batch fails the
way an out-of-memory run does (train_script.py's --fail_above_mbs), so the search records and skips
failures. The choice is checked against the metrics the runs themselves wrote, never against a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_ranks

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("train_script.py"))


def test_tune_then_run_trains_with_the_best_measured_config(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": [2, 4],
        "zero_optimization": {"stage": [0, 1]},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 1,
            "end_profile_step": 2,
            "experiment_timeout": 300,
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29731",
         "--autotuning", "run", SCRIPT, "--deepspeed_config", "ds.json", "--report", "trained.json",
         "--fail_above_mbs", "2", "--steps", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]

    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    names = ["z0_gas1_tmbspg2", "z0_gas1_tmbspg4", "z1_gas1_tmbspg2", "z1_gas1_tmbspg4"]
    assert sorted(p.stem for p in exps.glob("*.json")) == names
    measured = {}
    for name in names:
        folder = results / name
        for produced in ("ds_config.json", "exp.json", "cmd.txt", "stdout.log", "stderr.log"):
            assert (folder / produced).is_file(), f"{name}/{produced}"
        used = json.loads((folder / "ds_config.json").read_text())
        assert used["autotuning"]["enabled"] and used["autotuning"]["metric_path"] == str(
            folder / "metrics.json"
        )
        if used["train_micro_batch_size_per_gpu"] > 2:  # the simulated out-of-memory runs: recorded, skipped
            assert not (folder / "metrics.json").exists()
            assert "simulated out of memory" in (folder / "stderr.log").read_text()
        else:
            metrics = json.loads((folder / "metrics.json").read_text())
            assert metrics["measured_steps"] == 2 and metrics["throughput"] > 0
            assert metrics["throughput"] == pytest.approx(
                metrics["train_batch_size"] / (metrics["latency"] / 1000)
            )
            measured[name] = metrics["throughput"]

    best = max(measured, key=measured.get)  # the autotuner's choice must be the best recorded metric
    summary = (results / "summary.txt").read_text()
    assert "| global " in summary and best in summary.split("| global")[1].splitlines()[0]
    assert "Total number of experiments: 4." in summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    expected = json.loads((results / best / "ds_config.json").read_text())
    expected.pop("autotuning")
    assert optimal == expected
    cmd = (results / "cmd_optimal.txt").read_text().split()
    assert cmd[cmd.index("--deepspeed_config") + 1] == str(results / "ds_config_optimal.json")

    trained = json.loads((tmp_path / "trained.json").read_text())  # `run`: the script trained to its end
    assert trained["config"] == optimal and trained["global_steps"] == 4


def _profiled_runs(folder: str) -> dict:
    """On each of 2 ranks: a data-parallel engine and a 2-stage pipeline engine with the autotuning block on,
    trained until the engine ends the run; returns the step each stopped at and its exit code."""
    import torch
    from pipe_common import global_batches, layer_specs, loss_fn

    import shardspeed
    from shardspeed.pipe import PipelineModule

    shardspeed.init_distributed(dist_backend="gloo")
    block = {"enabled": True, "start_profile_step": 1, "end_profile_step": 2}
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    stopped = {}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {**base, "autotuning": {**block, "metric": "flops", "metric_path": f"{folder}/plain.json"}}
    engine, *_ = shardspeed.initialize(model=model, config=config)
    try:
        for _ in range(10):
            engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
            engine.step()
    except SystemExit as done:
        stopped["plain"] = (engine.global_steps, done.code)
    pipe = PipelineModule(layer_specs(), num_stages=2, loss_fn=loss_fn)
    config = {
        **base,
        "gradient_accumulation_steps": 2,
        "autotuning": {**block, "metric_path": f"{folder}/pipe.json"},
    }
    engine, *_ = shardspeed.initialize(model=pipe, config=config)
    inputs, labels = global_batches(10, 4)
    try:
        for step in range(10):
            batches = iter([(inputs[step, i : i + 2], labels[step, i : i + 2]) for i in (0, 2)])
            engine.train_batch(batches)
    except SystemExit as done:
        stopped["pipe"] = (engine.global_steps, done.code)
    return stopped


def test_engines_measure_the_profiled_steps_then_end_the_run(tmp_path):
    results = run_ranks(_profiled_runs, 2, str(tmp_path))
    for rank in (0, 1):  # every rank leaves at the same step, with exit code 0
        assert results[rank] == {"plain": (3, 0), "pipe": (3, 0)}
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert plain["measured_steps"] == 2 and plain["train_batch_size"] == 4
    assert plain["latency"] > 0 and plain["throughput"] == pytest.approx(4 / (plain["latency"] / 1000))
    forward_flops = 2 * 2 * (8 * 8 + 8 * 1)  # one micro-batch of 2 through both linear layers
    assert plain["flops"] == pytest.approx(3 * forward_flops / (plain["latency"] / 1000))
    pipe = json.loads((tmp_path / "pipe.json").read_text())
    assert pipe["train_batch_ms"] > 0 and pipe["latency"] == pytest.approx(pipe["train_batch_ms"])
