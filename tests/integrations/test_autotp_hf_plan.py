"""AutoTP training of Hugging Face models placed by their own tp_plan, through the `deepspeed` alias (2 ranks).

The job (autotp_hf_plan_job.py) trains an untied Qwen2 and a tied Llama at tp 2 (fp32, ZeRO 1) with no
partition_config: the losses equal the unsharded model's, each rank holds half of q_proj, the untied head is
column-parallel with its logits gathered (the plan's `colwise_gather_output`), and the tied head stays whole.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed (integration stage only)")

from .jobs import run_job


def test_hf_tp_plan_trains_equal_to_one_process(tmp_path):
    results = run_job("autotp_hf_plan_job.py", tmp_path)
    qwen, llama = results["qwen2"], results["llama"]
    for family, result in results.items():
        assert result["loss_diff"] < 1e-5, (family, result)
        assert result["q_fraction"] == 0.5 and result["logits_width"] == 128, (family, result)
    assert (qwen["head"], qwen["head_gathered"], qwen["head_tied"]) == ("LinearLayer", True, False), qwen
    assert (llama["head"], llama["head_tied"]) == ("Linear", True), llama
