"""ALST through Accelerate's `ParallelismConfig(sp_backend="deepspeed", sp_size=2)` and the Hugging Face
Trainer, on the `deepspeed` alias: a tiny Llama (ZeRO-3) and Qwen2 (ZeRO-2), attn_implementation="sdpa",
trained on 2 ranks with Ulysses give the losses of one process on whole sequences.

Measured (fp32, CPU, 6 steps): the largest step-loss difference to the one-process run was 4.8e-7 (one fp32
ulp at these losses) for Llama and for Qwen2; the tolerance is 1e-5. Needs transformers and accelerate (the `[hf]` extra); skipped without them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers, accelerate)")
pytest.importorskip("accelerate", reason="needs the [hf] extra (transformers, accelerate)")

from .jobs import run_job

TOLERANCE = 1e-5


@pytest.mark.parametrize(("model", "stage"), [("llama", 3), ("qwen2", 2)])
def test_trainer_with_ulysses_sp2_gives_the_losses_of_one_process(tmp_path, model, stage):
    # the same ZeRO stage in both: under a ZeRO-3 config the Trainer builds the model inside zero.Init
    reference = run_job("alst_trainer_job.py", tmp_path / "sp1", "--sp", "1", "--models", model, "--stage",
                        str(stage), nproc=1)[model]  # fmt: skip
    ulysses = run_job("alst_trainer_job.py", tmp_path / "sp2", "--sp", "2", "--models", model,
                      "--stage", str(stage))[model]  # fmt: skip
    # Ulysses ran: each rank's model saw half of every 32-token sequence, through the wrapper
    assert reference["lengths"] == [32] and ulysses["lengths"] == [16], (reference, ulysses)
    assert reference["attention"] == "sdpa_attention_forward"
    assert ulysses["attention"].endswith("ulysses_attention"), ulysses["attention"]
    assert ulysses["engine"] == "ShardspeedEngine"
    want, got = reference["loss"], ulysses["loss"]
    assert len(want) == 6 and want.keys() == got.keys(), (want, got)
    assert all(abs(got[s] - want[s]) <= TOLERANCE for s in want), (want, got)
    assert want["6"] < want["1"] - 0.05, want  # it learns
