"""AutoEP in one process: the expert_parallel block's parsing and checks, the presets, the router's routing
semantics, grouped experts, weight repacking, and detection/replacement matching the source blocks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from autoep_common import FFN, H, TinyMixtral, build
from torch import nn

from shardspeed.moe.autoep import AutoEP, AutoEPMoELayer, parse_autoep_config
from shardspeed.moe.autoep.config import AutoEPConfig, fill_autoep_config_from_hf
from shardspeed.moe.autoep.detect import resolve_route_scale
from shardspeed.moe.autoep.experts import GroupedExperts, classify_fused_gate_up_layout
from shardspeed.moe.autoep.layer import combine_from_routed
from shardspeed.moe.autoep.presets import PRESET_MODELS, preset_name_for_hf_model_type
from shardspeed.moe.autoep.router import TokenChoiceTopKRouter
from shardspeed.moe.autoep.validate import validate_autoep_config, validate_autoep_post_detection

# -- the block ----------------------------------------------------------------------------------------------


def test_block_defaults_and_explicit_load_balance_null():
    config = parse_autoep_config({})
    assert (config.enabled, config.autoep_size, config.use_grouped_mm, config.route_scale) == (
        False,
        1,
        True,
        1.0,
    )
    assert config.load_balance_coeff is None and not config._load_balance_coeff_explicit
    assert parse_autoep_config({"enabled": True, "load_balance_coeff": None})._load_balance_coeff_explicit


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ({"enabled": True, "autoep_sise": 2}, "autoep_sise"),
        ({"enabled": True, "load_balance_coeff": 0.01}, "load_balance_coeff"),
    ],
)
def test_block_refuses_unknown_keys_and_expert_bias(block, match):
    with pytest.raises(ValueError, match=match):
        parse_autoep_config(block)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"autoep_size": 3}, "must divide the stage size"),
        ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),
        ({"score_apply": "middle"}, "score_apply"),
        ({"comm_backend": "deepep"}, "deepep"),
        ({"combine_impl": "fused_weighted_sum"}, "fused_weighted_sum"),
        ({"comm_num_sm": 24}, "comm_num_sm"),
        ({"async_split_plan": True}, "async_split_plan"),
        ({"row_weighting_impl": "fused"}, "row_weighting_impl"),
        ({"preset_model": "gpt2"}, "preset_model"),
        ({"expert_w1": "a.b"}, "expert_w1"),
        ({"num_expert_groups": 2, "num_limited_groups": 3}, "num_limited_groups"),
    ],
)
def test_validation_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_autoep_config(
            AutoEPConfig(enabled=True, **overrides), world_size=8, pp_size=1, tp_size=1, sp_size=1
        )


def test_post_detection_checks_sizes_against_each_layer():
    spec = AutoEP(build(), AutoEPConfig(enabled=True, use_grouped_mm=False)).ep_parser()[0]
    validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=2), [spec])
    with pytest.raises(ValueError, match="exceeds num_experts"):
        validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=8), [spec])
    with pytest.raises(ValueError, match="not divisible"):
        validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=3), [spec])


def test_route_scale_comes_from_the_block_then_the_model():
    class DeepSeekConfig:
        routed_scaling_factor, n_group, topk_group = 2.5, 4, 2

    config = AutoEPConfig(enabled=True)
    fill_autoep_config_from_hf(config, DeepSeekConfig())
    assert (config.num_expert_groups, config.num_limited_groups, config.route_scale) == (4, 2, 2.5)
    assert resolve_route_scale(AutoEPConfig(routed_scaling_factor=3.0), DeepSeekConfig()) == 3.0
    assert resolve_route_scale(AutoEPConfig(), DeepSeekConfig()) == 2.5
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        resolve_route_scale(AutoEPConfig(routed_scaling_factor=float("nan")), None)


def test_presets_and_model_types():
    assert set(PRESET_MODELS) == {"mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3"}
    assert preset_name_for_hf_model_type("qwen2_moe") == "qwen3_moe"
    assert preset_name_for_hf_model_type("llama") is None
    assert (
        PRESET_MODELS["deepseek_v3"].score_func == "sigmoid" and not PRESET_MODELS["deepseek_v3"].route_norm
    )


# -- routing and experts ------------------------------------------------------------------------------------


def test_router_scale_norm_and_group_limited_routing():
    torch.manual_seed(0)
    x = torch.randn(40, 16)
    base = TokenChoiceTopKRouter(16, 8, None, None, 2, "softmax", True, 1.0, False)
    scaled = TokenChoiceTopKRouter(16, 8, None, None, 2, "softmax", True, 2.5, False)
    scaled.load_state_dict(base.state_dict())
    scores, experts, counts = base(x)
    torch.testing.assert_close(scores.sum(-1), torch.ones(40))  # route_norm: weights sum to one
    scaled_scores, scaled_experts, _ = scaled(x)
    assert torch.equal(scaled_experts, experts) and torch.allclose(scaled_scores, scores * 2.5)
    assert counts.dtype == torch.int32 and int(counts.sum()) == 80
    # 4 groups of 2 experts, one group allowed: both experts of a token come from the same group
    limited = TokenChoiceTopKRouter(16, 8, 4, 1, 2, "softmax", False, 1.0, False)
    _, chosen, _ = limited(x)
    assert torch.equal(chosen[:, 0] // 2, chosen[:, 1] // 2)


def test_correction_bias_steers_the_choice_not_the_weights():
    router = TokenChoiceTopKRouter(16, 4, None, None, 1, "sigmoid", False, 1.0, False)
    router.e_score_correction_bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    x = torch.randn(6, 16)
    scores, chosen, _ = router(x)
    assert torch.all(chosen == 3)
    torch.testing.assert_close(scores[:, 0], torch.sigmoid(router.gate(x))[:, 3])


def test_grouped_experts_loop_and_grouped_mm_compute_each_experts_swiglu():
    torch.manual_seed(0)
    loop = GroupedExperts(8, 12, 3, use_grouped_mm=False)
    for w in loop.parameters():
        nn.init.normal_(w, std=0.3)
    grouped = GroupedExperts(8, 12, 3, use_grouped_mm=True)
    grouped.load_state_dict(loop.state_dict())
    x, counts = torch.randn(7, 8), torch.tensor([3, 0, 4])
    expected = torch.cat(
        [
            (F.silu(rows @ loop.w1[e].t()) * (rows @ loop.w3[e].t())) @ loop.w2[e].t()
            for e, rows in enumerate(torch.split(x, counts.tolist()))
        ]
    )
    torch.testing.assert_close(loop(x, counts), expected)
    torch.testing.assert_close(grouped(x, counts), expected, rtol=1e-5, atol=1e-5)
    fused = GroupedExperts(8, 12, 3, use_grouped_mm=True, gate_up_impl="fused")  # gate and up as one product
    fused.load_state_dict(loop.state_dict())
    torch.testing.assert_close(fused(x, counts), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        GroupedExperts(8, 12, 3, use_grouped_mm=False, activation="relu")


def test_fused_layout_classification():
    assert classify_fused_gate_up_layout((4, 24, 8), (4, 8, 12)).layout == "gate_up_first"
    hidden_first = classify_fused_gate_up_layout((4, 8, 24), (4, 12, 8))
    assert (hidden_first.layout, hidden_first.hidden_size, hidden_first.ffn_hidden_size) == (
        "hidden_first",
        8,
        12,
    )
    assert classify_fused_gate_up_layout((4, 8, 8), (4, 8, 8)) is None


def test_combine_weights_each_tokens_slots():
    expert_output = torch.arange(8.0).reshape(4, 2)  # (token, slot) rows in sorted order
    top_scores = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    order = torch.tensor([2, 0, 3, 1])  # row i belongs to flat slot order[i]
    out = combine_from_routed(expert_output, top_scores, order, 2, "post", "weighted_sum", (1, 2, 2))
    slots = torch.zeros(4, 2)
    slots[order] = expert_output
    torch.testing.assert_close(out[0, 0], 0.75 * slots[0] + 0.25 * slots[1])
    torch.testing.assert_close(out[0, 1], 0.5 * slots[2] + 0.5 * slots[3])


# -- detection and replacement -------------------------------------------------------------------------------


@pytest.mark.parametrize("use_grouped_mm", [False, True])
def test_replaced_mixtral_block_matches_the_source(use_grouped_mm):
    model = build()
    reference = copy.deepcopy(model)
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True, "use_grouped_mm": use_grouped_mm}))
    (spec,) = auto_ep.ep_parser()
    assert (spec.model_family, spec.hidden_size, spec.ffn_hidden_size, spec.num_experts) == (
        "mixtral",
        H,
        FFN,
        4,
    )
    auto_ep.replace_moe_layer(spec, ep_size=1, ep_rank=0)
    assert isinstance(model.model.layers[0].mlp, AutoEPMoELayer)
    x, y = torch.randn(2, 5, H), torch.randn(2, 5, H)
    torch.testing.assert_close(model(x, y), reference(x, y))


def test_replacement_keeps_frozen_flags_and_refuses_an_unknown_model():
    model = build()
    model.model.layers[0].mlp.experts.down_proj.requires_grad_(False)
    auto_ep = AutoEP(model, AutoEPConfig(enabled=True, use_grouped_mm=False))
    layer = auto_ep.replace_moe_layer(auto_ep.ep_parser()[0], 1, 0)
    assert layer.experts.w1.requires_grad and not layer.experts.w2.requires_grad
    with pytest.raises(ValueError, match="no MoE layers detected"):
        AutoEP(nn.Linear(2, 2), AutoEPConfig(enabled=True, preset_model="mixtral")).ep_parser()


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DeepSeekBlock(nn.Module):
    """DeepSeek-V3's routing: sigmoid scores + correction bias, 2 of 4 groups, top-2, scaled; a shared expert."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, 8, bias=False)
        self.gate.register_buffer("e_score_correction_bias", torch.randn(8) * 0.1)
        self.experts = nn.ModuleList(_Expert() for _ in range(8))
        self.shared_experts = _Expert()

    def forward(self, x):
        flat = x.reshape(-1, H)
        scores = torch.sigmoid(self.gate(flat))
        choice = (scores + self.gate.e_score_correction_bias).view(-1, 4, 2)
        best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
        mask = torch.ones(flat.shape[0], 4, dtype=torch.bool).scatter_(1, best_groups, False)
        chosen = choice.masked_fill(mask.unsqueeze(-1), float("-inf")).view(-1, 8).topk(2, dim=-1).indices
        weights = scores.gather(1, chosen) * 2.5
        out = torch.stack(
            [
                sum(weights[t, k] * self.experts[int(chosen[t, k])](flat[t]) for k in range(2))
                for t in range(len(flat))
            ]
        )
        return out.reshape(x.shape) + self.shared_experts(x)


class _DeepSeekConfig:
    model_type, n_routed_experts, num_experts_per_tok = "deepseek_v3", 8, 2
    n_group, topk_group, routed_scaling_factor, norm_topk_prob = 4, 2, 2.5, False


def test_deepseek_v3_module_list_experts_group_routing_and_shared_expert(monkeypatch):
    from shardspeed.moe.autoep.presets import get_preset_adapter

    monkeypatch.setattr(get_preset_adapter("deepseek_v3"), "_installed_transformers_version", lambda: "5.0.0")
    torch.manual_seed(0)
    model = TinyMixtral()
    model.config = _DeepSeekConfig()
    model.model.layers[0].mlp = _DeepSeekBlock()
    reference = copy.deepcopy(model)
    auto_ep = AutoEP(model, AutoEPConfig(enabled=True, use_grouped_mm=False))
    (spec,) = auto_ep.ep_parser()
    assert (spec.model_family, spec.expert_storage, spec.num_expert_groups, spec.route_scale) == (
        "deepseek_v3",
        "module_list",
        4,
        2.5,
    )
    layer = auto_ep.replace_moe_layer(spec, 1, 0)
    assert "e_score_correction_bias" in dict(layer.router.named_buffers())
    x, y = torch.randn(2, 5, H), torch.randn(2, 5, H)
    torch.testing.assert_close(model(x, y), reference(x, y))


def test_engine_refuses_autoep_with_zero_3_autotp_and_an_unknown_key():
    from shardspeed.moe.autoep.apply import apply_autoep

    class Block:
        enabled, options = True, {"autoep_size": 1}

    class Unknown:
        enabled, options = True, {"autoep_sise": 1}

    with pytest.raises(ValueError, match="autoep_sise"):
        apply_autoep(build(), Unknown())
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        apply_autoep(build(), Block(), zero_stage=3)
    with pytest.raises(ValueError, match="autotp_size=2"):
        apply_autoep(build(), Block(), tp_size=2)


class _CustomBlock(nn.Module):
    """A block under names no preset uses: router `route`, experts `bank` with separate 3D gate/up weights."""

    def __init__(self):
        super().__init__()
        self.route = nn.Linear(H, 4, bias=False)
        self.bank = nn.Module()
        self.bank.g, self.bank.u = nn.Parameter(torch.randn(4, FFN, H)), nn.Parameter(torch.randn(4, FFN, H))
        self.bank.d = nn.Parameter(torch.randn(4, H, FFN))
        self.extra = _Expert()
        self.extra_gate = nn.Linear(H, 1, bias=False)


def test_block_keys_override_the_preset_in_detection():
    model = nn.Module()
    model.config = type("Cfg", (), {"experts_total": 4, "k": 3})()
    model.blocks = nn.ModuleList([_CustomBlock()])
    block = {
        "enabled": True, "moe_layer_pattern": r"blocks\.\d+", "router_pattern": "route", "expert_pattern": "bank",
        "expert_w1": "g", "expert_w2": "d", "expert_w3": "u", "num_experts_attr": "experts_total", "top_k_attr": "k",
        "score_func": "sigmoid", "route_norm": False, "score_apply": "pre", "has_shared_experts": True,
        "shared_experts_pattern": "extra", "shared_experts_gate_pattern": "extra_gate", "expert_activation": "geglu_tanh", "use_grouped_mm": False,
    }  # fmt: skip
    (spec,) = AutoEP(model, parse_autoep_config(block)).ep_parser()
    assert (spec.model_family, spec.router_name, spec.experts_name, spec.num_experts, spec.top_k) == (
        "custom", "route", "bank", 4, 3,
    )  # fmt: skip
    assert (spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name) == ("g", "d", "u")
    assert (spec.score_func, spec.route_norm, spec.score_apply, spec.expert_activation) == (
        "sigmoid", False, "pre", "geglu_tanh",
    )  # fmt: skip
    assert spec.has_shared_experts and (spec.shared_experts_name, spec.shared_experts_gate_name) == (
        "extra",
        "extra_gate",
    )
    assert AutoEP(model, parse_autoep_config({**block, "top_k": 1})).ep_parser()[0].top_k == 1
    # the replaced block computes with those settings: sigmoid weights applied before the experts, GeGLU
    source = model.blocks[0]
    layer = AutoEP(model, parse_autoep_config(block)).replace_moe_layer(spec, 1, 0)
    x = torch.randn(1, 2, H)
    flat = x.reshape(-1, H)
    scores = torch.sigmoid(source.route(flat))
    weights, chosen = scores.topk(3, dim=-1)
    expected = torch.stack(
        [
            sum(
                (F.gelu(source.bank.g[e] @ (w * t), approximate="tanh") * (source.bank.u[e] @ (w * t)))
                @ source.bank.d[e].t()
                for w, e in zip(weights[i], chosen[i].tolist())
            )
            for i, t in enumerate(flat)
        ]
    ).reshape(x.shape) + torch.sigmoid(source.extra_gate(x)) * source.extra(x)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def test_deepspeed_config_parses_the_block_and_refuses_expert_bias():
    from shardspeed.compat.mirrors.runtime_config import DeepSpeedConfig

    block = {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}
    parsed = DeepSpeedConfig(
        {"train_micro_batch_size_per_gpu": 1, "expert_parallel": block}
    ).expert_parallel_config
    assert (parsed.enabled, parsed.preset_model, parsed.load_balance_coeff) == (True, "mixtral", None)
    with pytest.raises(ValueError, match=r"load_balance_coeff=0\.02"):
        DeepSpeedConfig(
            {"train_micro_batch_size_per_gpu": 1, "expert_parallel": {**block, "load_balance_coeff": 0.02}}
        )


@pytest.mark.parametrize(
    ("topology", "match"),
    [
        ({"world_size": 7, "pp_size": 2}, "pp_size=2 must divide world_size=7"),
        (
            {"tp_size": 3},
            r"autotp_size=3 must divide the stage size \(world_size=8 / pp_size=1 = 8\).*Valid autotp_size values: \[1, 2, 4, 8\]",
        ),
        ({"tp_size": 2, "sp_size": 2}, "mutually exclusive"),
        ({"use_data_before_expert_parallel": True}, "use_data_before_expert_parallel_"),
    ],
)
def test_topology_checks_name_what_is_wrong(topology, match):
    sizes = {"world_size": 8, "pp_size": 1, "tp_size": 1, "sp_size": 1, **topology}
    with pytest.raises(ValueError, match=match):
        validate_autoep_config(AutoEPConfig(enabled=True, autoep_size=2), **sizes)
    validate_autoep_config(
        AutoEPConfig(enabled=True, autoep_size=2), world_size=8, pp_size=2, tp_size=1, sp_size=1
    )
