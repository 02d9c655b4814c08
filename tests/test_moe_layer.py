"""The MoE layer in one process (ep 1): routing against a token-by-token reference, and its errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardspeed.moe.layer import MoE
from shardspeed.moe.sharded_moe import TopKGate
from shardspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

from moe_common import D, Expert


def reference_routing(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
    """(l_aux, exp_counts) computed token by token, as DeepSpeed defines them."""
    tokens, experts = logits.shape
    gates = torch.softmax(logits.double(), dim=1)
    counts, first = [0] * experts, [0] * experts
    for s in range(tokens):
        order = sorted(range(experts), key=lambda e: -gates[s, e].item())
        first[order[0]] += 1
        for e in order[:k]:
            counts[e] += 1
    me = gates.mean(dim=0)
    if k == 1:
        l_aux = sum(me[e] * counts[e] / tokens for e in range(experts)) * experts
    else:
        ce = first if k == 2 else counts
        l_aux = (
            sum(me[e] * ce[e] / tokens for e in range(experts))
            / experts
            * experts
            * experts
            / (k if k > 2 else 1)
        )
    return l_aux.float(), counts


def reference_output(layer: MoE, x: torch.Tensor, k: int, capacity: int | None) -> torch.Tensor:
    """Each token through its kept experts, weighted by its renormalised gates. An over-full expert keeps
    tokens in order, every token's first choice before any second choice."""
    tokens = x.reshape(-1, x.shape[-1])
    gates = torch.softmax(tokens @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    choices = [sorted(range(len(experts)), key=lambda e: -gates[s, e].item())[:k] for s in range(len(tokens))]
    used = [0] * len(experts)
    kept = [[] for _ in tokens]
    for rank in range(k):
        for s, chosen in enumerate(choices):
            e = chosen[rank]
            if capacity is None or used[e] < capacity:
                used[e] += 1
                kept[s].append(e)
    out = torch.zeros_like(tokens)
    for s, es in enumerate(kept):
        total = sum(gates[s, e] for e in es) if k > 1 else 1.0
        for e in es:
            out[s] += gates[s, e] / total * experts[e](tokens[s])
    return out.reshape(x.shape)


def _layer(k: int, drop: bool, experts: int = 4, capacity_factor: float = 1.0) -> MoE:
    torch.manual_seed(1)
    layer = MoE(D, Expert(), num_experts=experts, k=k, capacity_factor=capacity_factor, min_capacity=1,
                drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False)  # fmt: skip
    with torch.no_grad():
        for e, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(e))
    return layer


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop", [True, False])
def test_routing_matches_token_by_token_reference(k, drop):
    layer = _layer(k, drop)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(3))
    out, l_aux, counts = layer(x)
    logits = x.reshape(-1, D) @ layer.deepspeed_moe.gate.wg.weight.t()
    ref_l_aux, ref_counts = reference_routing(logits.detach(), k)
    capacity = max(math.ceil(15 / 4 * k), 1) if drop else None
    torch.testing.assert_close(out, reference_output(layer, x, k, capacity), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, ref_l_aux, rtol=1e-6, atol=1e-7)
    assert counts.tolist() == ref_counts
    if drop:  # capacity 4 (top-1) of 15 tokens over 4 experts: some expert overflows and drops tokens
        assert k == 2 or max(ref_counts) > capacity


def test_top3_and_residual_and_noisy_gates_run():
    torch.manual_seed(0)
    layer = MoE(D, Expert(), num_experts=4, k=3, use_residual=True, min_capacity=1)
    x = torch.randn(2, 5, D)
    out, l_aux, counts = layer(x)
    assert out.shape == x.shape and counts.sum().item() == 30 and l_aux.item() > 0
    out.sum().backward()
    assert layer.coefficient.weight.grad is not None and layer.mlp.up.weight.grad is not None
    for policy, k in (("Jitter", 1), ("RSample", 1), (None, 2)):
        noisy = MoE(D, Expert(), num_experts=4, k=k, noisy_gate_policy=policy, use_rts=True, min_capacity=1)
        assert noisy(x)[0].shape == x.shape


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by ep_size \(4\)"):
        MoE(D, Expert(), num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match=r"k=3 .* num_experts=2"):
        MoE(D, Expert(), num_experts=2, k=3)
    with pytest.raises(ValueError, match="k=5 must be between 1 and num_experts=4"):
        TopKGate(D, 4, k=5)
    with pytest.raises(NotImplementedError, match=r"use_tutel=True.*not available"):
        MoE(D, Expert(), num_experts=2, use_tutel=True)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(D, Expert(), num_experts=2, noisy_gate_policy="Gaussian")
    wrong = MoE(D, nn.Linear(D, D + 1), num_experts=2)
    with pytest.raises(ValueError, match=r"output must have its input's shape"):
        wrong(torch.randn(2, 3, D))
    from shardspeed.config import ConfigError
    from shardspeed.moe.parallelism import ExpertParallelism

    with pytest.raises(ConfigError, match="use_data_before_expert_parallelism"):
        ExpertParallelism.discover(nn.Sequential(MoE(D, Expert(), num_experts=2)), data_before_expert=True)
    with pytest.raises(RuntimeError, match="ep_size=2 has no expert-parallel group"):
        MoE(D, Expert(), num_experts=2, ep_size=2)(torch.randn(2, 3, D))


def test_param_groups_split_experts_from_dense():
    model = nn.Sequential(nn.Linear(D, D), MoE(D, Expert(), num_experts=2))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "lr": 0.1}, max_group_size=3 * D * D
    )
    dense, *experts = groups
    assert not any(is_moe_param(p) for p in dense["params"]) and dense["lr"] == 0.1
    assert experts and all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.1 for g in experts)
    assert len(experts) > 1  # cut at max_group_size
    n_expert = sum(p.numel() for p in model.parameters() if is_moe_param(p))
    assert sum(p.numel() for g in experts for p in g["params"]) == n_expert
