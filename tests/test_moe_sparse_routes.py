"""Sparse routes (`sparse_routes=True` on the gates, shardspeed/moe/sparse_routes.py): the same routing as the
dense combine weights, dropped choices flagged -1, and encode/decode moving tokens as the dense einsums do."""

from __future__ import annotations

import pytest
import torch

from shardspeed.moe.sharded_moe import top1gating, top2gating, topkgating
from shardspeed.moe.sparse_routes import route_slots, sparse_decode, sparse_encode


def _gates(k: int, logits, capacity_factor: float, sparse: bool):
    if k == 1:
        return top1gating(logits, capacity_factor, 0, use_rts=False, sparse_routes=sparse)
    if k == 2:
        return top2gating(logits, capacity_factor, 0, top2_2nd_expert_sampling=False, sparse_routes=sparse)
    return topkgating(logits, k, capacity_factor, 0, sparse_routes=sparse)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 4.0])  # 0.5 drops choices
@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_routes_rebuild_the_dense_combine_weights_and_move_tokens_alike(k, capacity_factor):
    torch.manual_seed(k)
    tokens, experts, d_model = 16, 4, 8
    logits, hidden = torch.randn(tokens, experts), torch.randn(tokens, d_model)
    l_aux, combine, dispatch, counts = _gates(k, logits, capacity_factor, sparse=False)
    sparse = _gates(k, logits, capacity_factor, sparse=True)
    s_aux, capacity, num_experts, indices, locations, gates, s_counts = sparse
    assert num_experts == experts and capacity == combine.shape[2]
    assert indices.shape == locations.shape == gates.shape == (k, tokens) and indices.dtype == torch.int32
    torch.testing.assert_close(s_aux, l_aux)
    torch.testing.assert_close(s_counts, counts)
    rebuilt = torch.zeros_like(combine)
    for idx, loc, gate in zip(indices, locations, gates, strict=True):
        kept = idx >= 0
        rebuilt[kept.nonzero().squeeze(1), idx[kept].long(), loc[kept].long()] += gate[kept]
        assert torch.all(gate[~kept] == 0)
    torch.testing.assert_close(rebuilt, combine)
    if capacity_factor == 0.5:
        assert (indices < 0).any()  # the case with drops is exercised

    slots = route_slots(indices, locations, experts, capacity)
    expected = torch.einsum("sec,sm->ecm", dispatch.float(), hidden)
    torch.testing.assert_close(sparse_encode(hidden, slots, experts, capacity), expected)
    expert_output = torch.randn_like(expected)
    expected = torch.einsum("sec,ecm->sm", combine, expert_output)
    decoded = sparse_decode(expert_output.view(experts * capacity, d_model), slots, gates, tokens)
    torch.testing.assert_close(decoded, expected)
