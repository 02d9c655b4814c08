"""TRL's SFT, DPO, GRPO and RLOO (both with a KL reference model) and reward-model trainers, unchanged, on 2
ranks at ZeRO 2 and 3.

At ZeRO-3 TRL builds the reference model's engine with dotted top-level keys (`"zero_optimization.
reduce_bucket_size"`, ...) and, for GRPO, takes the policy's ZeRO-3 hooks off around generation and puts them
back (`engine.optimizer.parameter_offload`); RLOO does the same. A tiny Llama built from a config, data built in memory, 3 steps
per run. Needs the [hf] extra (transformers, accelerate, trl); skipped without it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers, accelerate, trl)")
pytest.importorskip("trl", reason="needs the [hf] extra (transformers, accelerate, trl)")

from .jobs import run_job

TRAINERS = ("sft", "dpo", "grpo", "rloo", "reward")
RUNS = [f"{name}:{stage}" for name in TRAINERS for stage in (2, 3)] + ["grpo:3:offload", "grpo:3:offload_all"]
HIDDEN = 32  # trl_job.py's tiny Llama


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def test_trl_trainers_train_at_zero_2_and_3(tmp_path):
    results = run_job("trl_job.py", tmp_path, "--runs", *RUNS, "--steps", "3")
    for name in TRAINERS:
        zero2 = results[f"{name}:2"]
        assert len(zero2["loss"]) == 3, zero2
        offloaded = ["grpo:3:offload", "grpo:3:offload_all"] if name == "grpo" else []
        for run in [f"{name}:3", *offloaded]:
            # ZeRO-3 (and ZeRO-3 with the optimizer, or the optimizer and the parameters, on the host) gives
            # ZeRO-2's losses: same data, same sampling, fp32
            assert _close(results[run]["loss"], zero2["loss"], 1e-5), (run, results[run], zero2)
            if "kl" in zero2:  # the sampled completions are the same, the reference model's view too
                assert results[run]["reward"] == zero2["reward"]
                assert _close(results[run]["kl"], zero2["kl"], 1e-6), (run, results[run], zero2)
    assert results["sft:2"]["loss"][-1] < results["sft:2"]["loss"][0]  # it learns
    assert results["dpo:2"]["rewards/margins"][-1] > 0
    assert results["reward:2"]["loss"][-1] < results["reward:2"]["loss"][0]
    for run in ("grpo:3", "grpo:3:offload", "grpo:3:offload_all", "rloo:3"):
        assert results[run]["kl"][-1] != 0  # the reference model is in use and the policy has moved
    for run in (
        "dpo:3",
        "grpo:3",
        "rloo:3",
    ):  # TRL's prepare_deepspeed: its dotted keys reached the reference engine
        assert results[run]["reference"] == "engine"
        assert results[run]["reference optimizer is DeepSpeedZeRoOffload"]
        assert results[run]["reference zero"] == {
            "stage": 3,
            "reduce_bucket_size": HIDDEN * HIDDEN,
            "stage3_param_persistence_threshold": 10 * HIDDEN,
            "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),  # 921.6 elements, rounded down
        }
    assert results["dpo:2"]["reference"] == "engine"  # prepare_deepspeed at stage 0 below ZeRO-3
