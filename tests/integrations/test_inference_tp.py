"""Tensor-parallel inference on Hugging Face models through the `deepspeed` alias (2 ranks, torchrun).

The job (inference_tp_job.py) is a DeepSpeed inference script that never names shardspeed. For GPT-2,
Llama, Mistral, Qwen2 and OPT: logits equal to the unsharded model's (fp32, <= 1e-4), greedy tokens equal to
the model's own `generate` (one row left-padded), about half of the blocks' linear weights per rank; and
models rebuilt on the meta device load their shard tensor by tensor from `save_pretrained` safetensors.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed (integration stage only)")

from .jobs import run_job

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "opt")


def test_tensor_parallel_inference_matches_one_process(tmp_path):
    results = run_job("inference_tp_job.py", tmp_path)
    for family in FAMILIES:
        result = results[family]
        assert result["logits_diff"] <= 1e-4, (family, result)
        assert result["tokens_equal"], (family, result)
        assert 0.45 <= result["linear_fraction"] <= 0.55, (family, result)
        assert result["module_is_model"], family
    for family in ("llama", "mistral", "qwen2"):
        assert results[family]["decoder"] == "FastDecoder", family
    for family in ("gpt2", "opt"):
        assert results[family]["decoder"] == "ModelDecoder", family
    for key in ("meta_llama", "meta_gpt2"):
        assert results[key]["logits_diff"] <= 1e-4, (key, results[key])
        assert results[key]["tokens_equal"], (key, results[key])
