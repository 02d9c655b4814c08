"""Accelerate used directly: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`, prepare,
backward, step, save_state/load_state and get_state_dict, at ZeRO 0, 2 and 3 on 2 ranks. Needs accelerate
and transformers (the `[hf]` extra); skipped without them."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers, accelerate)")
pytest.importorskip("accelerate", reason="needs the [hf] extra (transformers, accelerate)")

from .jobs import run_job


def test_accelerate_prepare_step_save_and_load_state(tmp_path):
    results = run_job("accelerate_job.py", tmp_path, "--stages", "0", "2", "3")
    reference = [results["0"]["train"][str(s)] for s in range(1, 9)]
    assert reference[-1] < reference[0] - 0.2, reference  # it learns
    for stage in "023":
        run = results[stage]
        train = [run["train"][str(s)] for s in range(1, 9)]
        assert all(abs(a - b) <= 1e-5 for a, b in zip(train, reference)), (stage, train, reference)
        resumed = [run["resumed"][str(s)] for s in range(5, 9)]
        assert all(abs(a - b) <= 1e-6 for a, b in zip(resumed, train[4:])), (stage, resumed, train[4:])
        assert run["state_dict_numel"] == results["0"]["state_dict_numel"]  # full weights, every stage
