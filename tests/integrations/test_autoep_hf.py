"""AutoEP on real Hugging Face MoE models (Transformers 5's fused expert layout): Mixtral and Qwen3-MoE blocks,
found by `model_type` and replaced by AutoEP layers, give the native model's logits and loss, and gradients
reach the repacked experts. Needs transformers (the `[hf]` extra); skipped without it."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

from shardspeed.moe.autoep import AutoEP, AutoEPMoELayer, parse_autoep_config  # noqa: E402

SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, num_experts_per_tok=2, use_cache=False, tie_word_embeddings=False,
)  # fmt: skip


def _models():
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4)
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **SMALL, num_hidden_layers=1, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True
            )
        ),
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_replaced_hf_blocks_give_the_native_logits_and_loss(family):
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("AutoEP's presets follow Transformers 5's fused expert layout")
    torch.manual_seed(0)
    native = _models()[family]()
    model = copy.deepcopy(native)
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True, "use_grouped_mm": False}))
    specs = auto_ep.ep_parser()
    assert specs and all(spec.model_family == family for spec in specs)
    auto_ep.replace_moe_layers(specs, ep_size=1, ep_rank=0)
    assert sum(isinstance(m, AutoEPMoELayer) for m in model.modules()) == len(specs)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    expected, got = native(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    got.loss.backward()
    expected.loss.backward()
    layer, source = model.model.layers[0].mlp, native.model.layers[0].mlp
    ffn = layer.experts.w1.shape[1]
    torch.testing.assert_close(
        layer.experts.w1.grad, source.experts.gate_up_proj.grad[:, :ffn], rtol=1e-4, atol=1e-6
    )
    torch.testing.assert_close(layer.experts.w2.grad, source.experts.down_proj.grad, rtol=1e-4, atol=1e-6)
