"""DeepSpeed-Chat's step-3 loop (actor on the hybrid engine, critic, reference and reward engines) on 2 ranks,
tiny Llama and OPT models built from configs (dschat_step3_job.py). The actor is a `DeepSpeedHybridEngine`; its
first rollouts (left-padded prompts, `actor.module.generate(..., synced_gpus=True)` at ZeRO-3) equal Hugging
Face's `generate` on the unsharded actor; at ZeRO-3 every rollout and loss equals ZeRO-2's (fp32).
Needs the [hf] extra (transformers); skipped without it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from .jobs import run_job

RUNS = ["llama:3", "llama:2", "opt:3", "opt:2"]


def test_dschat_step3_loop_with_the_hybrid_engine(tmp_path):
    results = run_job("dschat_step3_job.py", tmp_path, "--runs", *RUNS, "--steps", "2")
    for run in RUNS:
        out = results[run]
        assert out["is DeepSpeedHybridEngine"] and out["actor class"][0] == "HybridEngine", run
        assert out["first rollouts equal HF generate"], run
        assert len(out["actor_loss"]) == 2 and len(out["critic_loss"]) == 2
    for family in ("llama", "opt"):
        zero3, zero2 = results[f"{family}:3"], results[f"{family}:2"]
        assert zero3["seq"] == zero2["seq"]  # the second step's rollouts come from the updated actor
        assert zero3["actor_loss"] == pytest.approx(zero2["actor_loss"], abs=1e-5)
        assert zero3["critic_loss"] == pytest.approx(zero2["critic_loss"], abs=1e-5)


TP_LORA_RUNS = ["llama:3", "llama:3:tp2", "llama:3:lora", "llama:3:lora:tp2"]


def test_dschat_step3_with_tensor_parallel_generation_and_a_lora_actor(tmp_path):
    """The Llama actor generating with `inference_tp_size` 2, with LoRA, and both: the same rollouts and
    losses as `inference_tp_size` 1 (the rollouts decide the losses, and generate writes no weight)."""
    results = run_job("dschat_step3_job.py", tmp_path, "--runs", *TP_LORA_RUNS, "--steps", "2")
    for run in TP_LORA_RUNS:
        assert results[run]["first rollouts equal HF generate"], run  # LoRA starts at zero: the base model
    for plain, tp2 in (("llama:3", "llama:3:tp2"), ("llama:3:lora", "llama:3:lora:tp2")):
        assert results[tp2]["seq"] == results[plain]["seq"], tp2
        assert results[tp2]["actor_loss"] == pytest.approx(results[plain]["actor_loss"], abs=1e-6)
        assert results[tp2]["critic_loss"] == pytest.approx(results[plain]["critic_loss"], abs=1e-6)
        one, two = results[plain]["decode weight bytes"], results[tp2]["decode weight bytes"]
        assert two["shards"] > 0 and sum(two.values()) < sum(one.values()), (one, two)
    assert results["llama:3:lora"]["lora fused"] == 14  # q, k, v, o, gate, up, down in each of 2 layers
    assert results["llama:3:lora:tp2"]["lora fused"] == 0  # split with LoRA folded in, nothing to run fused
