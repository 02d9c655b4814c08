"""AutoEP folded onto AutoTP, the parts that need no process group: the rank layout and its checks
(moe/autoep/folding.py), the gradient families (folding_grads.py), and splitting / restoring routed
assignments on one lane (ep_tp_dispatch.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardspeed.moe.autoep import AutoEPConfig, validate_autoep_config
from shardspeed.moe.autoep import ep_tp_dispatch as dispatch
from shardspeed.moe.autoep import folding_grads as grads
from shardspeed.moe.autoep.folding import (
    assert_group_matches_spec,
    build_folding_spec,
    expected_folding_group_tables,
    local_folding_ranks,
)

# -- layout ------------------------------------------------------------------------------------------------


def _every_rank_once(groups, world):
    return sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize(("world", "tp", "ep"), [(8, 2, 4), (16, 2, 8), (4, 4, 2), (8, 4, 4), (12, 3, 2)])
def test_tables_partition_the_world_and_experts_replicate_across_expert_groups(world, tp, ep):
    spec = build_folding_spec(world_size=world, pp_size=1, tp_size=tp, ep_size=ep)
    assert (spec.dp_size, spec.edp_size) == (world // tp, world // ep)
    tables = expected_folding_group_tables(spec)
    for groups in (tables.tp_groups, tables.dense_dp_groups, tables.ep_groups, tables.edp_groups):
        assert _every_rank_once(groups, world)
    assert all(len(g) == tp and g == tuple(range(g[0], g[0] + tp)) for g in tables.tp_groups)
    assert all(len(g) == ep and g == tuple(range(g[0], g[0] + ep)) for g in tables.ep_groups)
    # the ranks of an expert-data-parallel group hold the same experts: one position of every expert group
    for edp in tables.edp_groups:
        assert len({r % ep for r in edp}) == 1 and len(edp) == world // ep
    local = local_folding_ranks(world - 1, spec)
    assert all(world - 1 in ranks for ranks in local.values())


def test_pipeline_stages_hold_their_own_groups():
    spec = build_folding_spec(world_size=8, pp_size=2, tp_size=1, ep_size=2)
    tables = expected_folding_group_tables(spec)
    assert tables.ep_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert tables.edp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        (
            {"world_size": 6, "pp_size": 4},
            r"pp_size=4 must divide world_size=6. Valid pp_size values: \[1, 2, 3, 6\]",
        ),
        ({"tp_size": 3}, r"autotp_size=3 must divide the stage size .*\[1, 2, 4, 8\]"),
        ({"ep_size": 3}, r"\(3 \* 1 = 3\) must divide the stage size .*Valid expert-width values"),
        ({"ep_size": 0}, "expert_parallel.autoep_size must be a positive integer, got 0"),
    ],
)
def test_sizes_that_do_not_tile_are_refused_naming_valid_values(sizes, match):
    with pytest.raises(ValueError, match=match):
        build_folding_spec(**{"world_size": 8, "pp_size": 1, "tp_size": 2, "ep_size": 2, **sizes})


def test_rank_lists_of_another_layout_are_refused():
    spec = build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4)
    tables = expected_folding_group_tables(spec)
    assert_group_matches_spec((tables.ep_groups, tables.edp_groups), spec)
    assert_group_matches_spec({"ep": tables.ep_groups[:1], "edp": ()}, spec)
    with pytest.raises(RuntimeError, match=r"expert-parallel group \(0, 2, 4, 6\) does not match"):
        assert_group_matches_spec((((0, 2, 4, 6),), ()), spec)  # the data-axis cut of an unfolded layout
    with pytest.raises(RuntimeError, match="expert-data-parallel group"):
        assert_group_matches_spec(((), ((0, 1),)), spec)


# -- validate_autoep_config with folding -------------------------------------------------------------------

_FOLDED = {"world_size": 4, "pp_size": 1, "tp_size": 2, "sp_size": 1}


@pytest.mark.parametrize(
    ("config", "inputs", "match"),
    [
        ({}, {"deepcompile_enabled": True}, "DeepCompile with AutoEP\\+AutoTP folding"),
        ({"autoep_size": 1}, {}, "autoep_size > 1"),
        ({"preset_model": "mixtral"}, {"tp_preset_model": "qwen3_moe"}, "must match"),
        ({}, {"zero_offload_optimizer": True}, "offload"),
        ({}, {"zero_offload_param": True}, "offload"),
        ({}, {"mpu": SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 4)}, "mpu tensor/model"),
        ({}, {"mpu": SimpleNamespace(get_pipeline_parallel_world_size=lambda: 2)}, "mpu pipeline"),
        ({}, {"pp_size": 2, "world_size": 8}, "pp_size=1 only"),
        ({}, {"sp_size": 2}, "mutually exclusive"),
        ({"expert_tensor_parallel_size": 2}, {"world_size": 8}, "expert_tensor_parallel_size=2 is reserved"),
    ],
)
def test_folded_configurations_refused_by_name(config, inputs, match):
    block = AutoEPConfig(**{"enabled": True, "autoep_size": 2, **config})
    with pytest.raises(ValueError, match=match):
        validate_autoep_config(block, **{**_FOLDED, **inputs})


def test_folding_only_inputs_do_not_touch_unfolded_layouts():
    block = AutoEPConfig(enabled=True, autoep_size=2)
    unfolded = {**_FOLDED, "tp_size": 1}
    validate_autoep_config(block, **unfolded, deepcompile_enabled=True, zero_offload_optimizer=True)
    validate_autoep_config(block, **{**unfolded, "world_size": 8, "pp_size": 2})
    validate_autoep_config(block, **_FOLDED, mpu=SimpleNamespace(get_model_parallel_world_size=lambda: 2))
    validate_autoep_config(
        AutoEPConfig(enabled=True, autoep_size=4), world_size=4, pp_size=1, tp_size=2, sp_size=1
    )


# -- gradient families -------------------------------------------------------------------------------------


def _param(**marks):
    p = torch.nn.Parameter(torch.zeros(2))
    for key, value in marks.items():
        setattr(p, key, value)
    return p


def test_gradient_strategy_follows_the_parameter_family():
    tp = SimpleNamespace(tp_size=2, mp_mode="tp")
    sp = SimpleNamespace(tp_size=2, mp_mode="sp")
    strategy = grads.autoep_folding_gradient_reduction_strategy
    assert strategy(None, _param()) == "skip"
    assert strategy(SimpleNamespace(tp_size=1), _param()) == "skip"
    assert strategy(tp, _param(tensor_model_parallel=True)) == "skip"
    assert strategy(tp, _param(allreduce=False)) == "expert_tp_cancel"
    assert strategy(tp, _param()) == "average"
    assert strategy(tp, _param(), param_name="model.layers.0.mlp.router.gate.weight") == "average"
    router, partial, norm = _param(), _param(), _param()
    grads.mark_autoep_folding_router_parameter(router)
    grads.mark_autoep_folding_partial_router_parameter(partial)
    grads.mark_autoep_folding_sp_sharded_layernorm_parameter(norm)
    assert strategy(tp, router) == "average"
    assert (strategy(tp, partial), strategy(sp, partial)) == ("sum", "sum")
    assert (strategy(tp, norm), strategy(sp, norm)) == ("average", "sum")


def test_expert_cancellation_divides_once_per_window():
    spec = SimpleNamespace(tp_size=2, mp_mode="tp")
    expert = _param(allreduce=False)
    grad = torch.full((2,), 4.0)
    size = {"get_world_size": lambda group=None: 2}
    original = grads.dist.get_world_size
    grads.dist.get_world_size = size["get_world_size"]
    try:
        assert (
            grads.apply_folding_correction_to_grad_buffer(spec, expert, grad, tp_group=None)
            == "expert_tp_cancel"
        )
        assert grads.apply_folding_correction_to_grad_buffer(spec, expert, grad, tp_group=None) == "skip"
        assert grads.is_autoep_folding_gradient_corrected(expert)
        grads.clear_autoep_folding_gradient_corrected(expert)
        grads.apply_folding_correction_to_grad_buffer(
            spec, expert, grad, tp_group=None, use_correction_marker=False
        )
    finally:
        grads.dist.get_world_size = original
    torch.testing.assert_close(grad, torch.full((2,), 1.0))


# -- dispatch on one lane ----------------------------------------------------------------------------------


def _payload(drop=(), pad=()):
    experts = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    mask = torch.zeros(9, dtype=torch.bool)
    drop_mask, pad_mask = mask.clone(), mask.clone()
    drop_mask[list(drop)] = True
    pad_mask[list(pad)] = True
    return dispatch.RoutedAssignmentPayload(
        token_indices=torch.tensor([0, 1, 2, 0, 3, 1, 2, 3, 4]),
        expert_indices=experts,
        assignment_indices=dispatch.assignment_ordinals_by_expert(experts),
        capacity_slots=torch.tensor([0, 0, 0, 1, 0, 1, 1, 1, 0]),
        combine_weights=torch.linspace(0.1, 0.9, 9),
        drop_mask=drop_mask,
        pad_mask=pad_mask,
        input_splits=[3, 2, 4],
        output_splits=[3, 2, 4],
        extra={"destination_ranks": experts, "num_tokens": torch.tensor(5)},
    )


def test_ordinals_count_within_each_run_of_an_expert():
    ordinals = dispatch.assignment_ordinals_by_expert(torch.tensor([3, 3, 3, 5, 7, 7]))
    assert ordinals.tolist() == [0, 1, 2, 0, 0, 1]
    assert dispatch.assignment_ordinals_by_expert(torch.tensor([], dtype=torch.long)).numel() == 0


@pytest.mark.parametrize("lanes", [2, 3])
def test_lanes_share_each_experts_assignments_round_robin(lanes):
    payload = _payload(drop=[4], pad=[8])
    shares = [
        dispatch.partition_assignments(payload, tp_group=None, tp_rank=r, tp_size=lanes) for r in range(lanes)
    ]
    kept = [set(ctx.local_indices.tolist()) for _, ctx in shares]
    assert set().union(*kept) == set(range(9)) - {4, 8}
    assert sum(len(k) for k in kept) == 7  # disjoint
    for local, ctx in shares:
        assert local.input_splits == torch.bincount(local.expert_indices, minlength=3).tolist()
        assert dispatch.dispatch_counters(ctx)["assignments_total"] == 7
        assert dispatch.dispatch_counters(ctx)["dropped"] == dispatch.dispatch_counters(ctx)["padded"] == 1
        assert (local.assignment_indices % lanes == ctx.tp_rank).all()


def test_restore_sums_weighted_topk_results_per_token_with_gradients():
    payload = _payload(drop=[2])
    payload.combine_weights.requires_grad_(True)
    local, ctx = dispatch.partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    values = torch.randn(local.token_indices.numel(), 3, requires_grad=True)
    restored = dispatch.restore_combined(values, ctx, tp_group=None, validate_coverage=True)
    expected = torch.zeros(5, 3).index_add(0, local.token_indices, values * local.combine_weights[:, None])
    torch.testing.assert_close(restored, expected)
    restored.sum().backward()
    torch.testing.assert_close(values.grad, local.combine_weights.detach()[:, None].expand(-1, 3))
    assert payload.combine_weights.grad[2] == 0 and payload.combine_weights.grad[0] != 0
    ctx.local_indices = ctx.local_indices[1:]
    with pytest.raises(RuntimeError, match="restore coverage mismatch"):
        dispatch.restore_combined(values[1:], ctx, tp_group=None, validate_coverage=True)


def test_digest_changes_with_any_field_and_divergence_is_reported(monkeypatch):
    base = dispatch._digest(_payload())
    assert torch.equal(base, dispatch._digest(_payload()))
    for change in ("token_indices", "combine_weights", "capacity_slots"):
        other = _payload()
        getattr(other, change)[3] += 1
        assert not torch.equal(base, dispatch._digest(other)), change
    calls = []

    def fake_all_reduce(
        tensor, op=None, group=None
    ):  # the other lane routed differently: its digest is higher
        if op == dispatch.dist.ReduceOp.MAX:
            tensor[4] += 1
        calls.append(op)

    monkeypatch.setattr(dispatch.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dispatch.dist, "all_reduce", fake_all_reduce)
    dispatch.assert_tp_payload_consistent(
        _payload(), tp_group=None, tp_size=1
    )  # one lane: nothing to compare
    assert calls == []
    with pytest.raises(RuntimeError, match="routing decisions differ"):
        dispatch.assert_tp_payload_consistent(_payload(), tp_group=None, tp_size=2)


def test_a_layer_bound_to_folding_handles_runs_folded_on_their_groups(monkeypatch):
    from autoep_common import build

    from shardspeed.moe.autoep import AutoEP, parse_autoep_config
    from shardspeed.moe.autoep.folding import FoldingGroupHandles

    block = {"enabled": True, "autoep_size": 2, "validate_folding_routing": True}
    auto_ep = AutoEP(build(), parse_autoep_config(block))
    layer = auto_ep.replace_moe_layer(auto_ep.ep_parser()[0], ep_size=2, ep_rank=0)
    spec = build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=2)
    local = local_folding_ranks(3, spec)
    handles = FoldingGroupHandles(
        spec,
        "tp",
        "dense",
        "ep",
        "edp",
        "ep_size_2",
        local["tp"],
        local["dense_dp"],
        local["ep"],
        local["edp"],
    )
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 3)
    layer.set_deepspeed_parallelism(folding_group_handles=handles)
    assert layer.folding_group_handles is handles and layer.folding.validate_routing
    assert (layer.tp_group, layer.ep_group, layer.ep_rank, layer.ep_group_name) == (
        "tp",
        "ep",
        1,
        "ep_size_2",
    )
    router = layer.router.gate.weight
    assert grads.autoep_folding_gradient_reduction_strategy(spec, router) == "average"
    assert router.ds_autoep_folding_param_family == grads.AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM
    wrong = build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="autoep_size=4 given to a layer of ep_size=2"):
        layer.set_deepspeed_parallelism(folding_group_handles=FoldingGroupHandles(wrong, *[None] * 9))
