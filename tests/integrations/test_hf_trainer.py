"""An unchanged Hugging Face Trainer script with `deepspeed=<config>` on 2 ranks at ZeRO 0-3.

Trains 8 steps saving at step 4, resumes a fresh Trainer from that checkpoint, and at ZeRO-3 saves the
model with `save_model`, reloads it with `from_pretrained` (partitioned, and plain) and generates. Needs
transformers and accelerate (the `[hf]` extra); skipped without them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers, accelerate)")
pytest.importorskip("accelerate", reason="needs the [hf] extra (transformers, accelerate)")

from .jobs import run_job


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def test_trainer_trains_saves_and_resumes_at_every_zero_stage(tmp_path):
    results = run_job("hf_trainer_job.py", tmp_path, "--stages", "0", "1", "2", "3")
    reference = list(results["0"]["train"].values())
    assert len(reference) == 8 and reference[-1] < reference[0] - 0.2, reference  # it learns
    for stage in "0123":
        run = results[stage]
        train = [run["train"][str(s)] for s in range(1, 9)]
        # ZeRO 1-3 give the losses of ZeRO 0 (same init, same data, fp32)
        assert _close(train, reference, 1e-5), (stage, train, reference)
        # resuming from checkpoint-4 reproduces steps 5-8 of the uninterrupted run
        resumed = [run["resumed"][str(s)] for s in range(5, 9)]
        assert _close(resumed, train[4:], 1e-6), (stage, resumed, train[4:])
        assert all(norm > 0 for norm in run["grad_norm"]), run["grad_norm"]

    zero3 = results["3"]
    assert zero3["params_at_start"] == 0  # from_config under zero.Init: parameters partitioned on creation
    assert results["2"]["params_at_start"] > 0
    # save_model wrote full weights: from_pretrained (plain, and partitioned under the ZeRO-3 config)
    # gives the trained model's logits and generation
    assert zero3["from_pretrained_local_numel"] == 0
    assert _close(zero3["reloaded_logits"], zero3["trained_logits"], 1e-5)
    assert _close(zero3["partitioned_logits"], zero3["trained_logits"], 1e-5)
    assert zero3["reloaded_generation"] == zero3["trained_generation"]
