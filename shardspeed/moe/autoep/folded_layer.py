"""An `AutoEPMoELayer` running folded onto AutoTP: its tensor lanes share the routed work, and how that is
set up for a model (groups from folding.py's tables, each layer told its lanes).

Forward on each lane of a tensor group (the lanes hold the same tokens, so they route identically):

1. route all tokens (replicated work: the router is small);
2. describe the (token, expert) assignments as a `RoutedAssignmentPayload`, sorted by expert, and keep this
   lane's share (`partition_assignments`): each expert's assignments dealt round-robin over the lanes;
3. send the share to the experts' owners over the expert-parallel group and back, as the unfolded layer does
   (`AutoEPMoELayer._dispatch_and_run`); the expert group spans lanes, so every assignment is computed once;
4. `restore_combined` gathers every lane's results and sums each token's weighted top-k results, so all
   lanes hold the whole output again.

Gradients. Every lane computes the same loss from that replicated output, and the gather's backward sums the
lanes' output gradients, so what lies before it receives `t` times its gradient from each lane's share
(t = tensor lanes). Three corrections make every gradient the unfolded layer's:
- the routing scores' gradient is averaged over the lanes: (1/t) * sum over lanes of t * (lane's share) =
  the whole gradient, on every lane, so the router (replicated) needs no further reduction;
- the layer's input gradient is averaged over the lanes for the same reason (the shared experts' part is
  the same on every lane and stays as it is);
- the experts' gradients are divided by t in their reduction domain (`ExpertGroup.tp_lanes`), where they are
  already scaled (moe/optimizer.py) — no extra pass over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from shardspeed.moe.autoep.ep_tp_dispatch import (
    RoutedAssignmentPayload,
    assert_tp_payload_consistent,
    assignment_ordinals_by_expert,
    average_gradient_over_tp,
    partition_assignments,
    restore_combined,
)
from shardspeed.moe.autoep.folding import (
    FoldingGroupHandles,
    ParallelFoldingSpec,
    expected_folding_group_tables,
    local_folding_ranks,
)
from shardspeed.moe.autoep.folding_grads import mark_autoep_folding_router_parameter

__all__ = ["FoldedDispatch", "build_folding_groups"]


class _Share(NamedTuple):
    """This lane's share of the routing, as `AutoEPMoELayer._dispatch_and_run` reads a `RouterOutput`."""

    top_scores: torch.Tensor | None
    selected_experts: torch.Tensor
    num_tokens_per_expert: torch.Tensor


def build_folding_groups(spec: ParallelFoldingSpec, tp_group, dense_dp_group):
    """This rank's `FoldingGroupHandles` and the engine's `ExpertGroups` for `spec` (collective: creates the
    expert and expert-data-parallel groups of the layout). `tp_group` / `dense_dp_group`: the AutoTP grid's,
    whose ranks must be the layout's (tensor ranks neighbours)."""
    from shardspeed.moe.groups import build_expert_groups_from_tables

    tables = expected_folding_group_tables(spec)
    local = local_folding_ranks(dist.get_rank(), spec)
    for kind, group in (("tp", tp_group), ("dense_dp", dense_dp_group)):
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks != local[kind]:
            raise ValueError(
                f"AutoEP+AutoTP folding: this rank's {kind} group is {ranks}, the folded layout needs {local[kind]}"
            )
    name = f"ep_size_{spec.ep_size}"
    groups = build_expert_groups_from_tables(
        name,
        spec.ep_size,
        tables.ep_groups,
        tables.edp_groups,
        dp_world_size=spec.dp_size,
        tp_lanes=spec.tp_size,
    )
    group = groups[name]
    handles = FoldingGroupHandles(
        spec=spec, tp_group=tp_group, dense_dp_group=dense_dp_group, ep_group=group.ep_group,
        edp_group=group.edp_group, ep_group_name=name, tp_ranks=local["tp"], dense_dp_ranks=local["dense_dp"],
        ep_ranks=local["ep"], edp_ranks=local["edp"],
    )  # fmt: skip
    return handles, groups


@dataclass
class FoldedDispatch:
    """What a folded layer needs: its group handles, whether to check every forward that the lanes routed
    alike and that the restore covered every assignment (`expert_parallel.validate_folding_routing`), and the
    engine's `ExpertGroups` of the layout (None when the handles were bound by hand)."""

    handles: FoldingGroupHandles
    validate_routing: bool = False
    groups: object = None

    @property
    def tp_size(self) -> int:
        return self.handles.spec.tp_size

    @classmethod
    def bind(cls, layer, handles: FoldingGroupHandles, groups=None) -> None:
        """Make `layer` run folded on `handles`' groups (`AutoEPMoELayer.set_deepspeed_parallelism`)."""
        if handles.spec.ep_size != layer.ep_size:
            raise ValueError(
                f"folding handles for autoep_size={handles.spec.ep_size} given to a layer of ep_size={layer.ep_size}"
            )
        layer.folding = cls(handles, layer.validate_folding_routing, groups)
        layer.folding_group_handles, layer.tp_group = handles, handles.tp_group
        layer.ep_group, layer.ep_rank = handles.ep_group, handles.ep_ranks.index(dist.get_rank())
        layer.ep_group_name = layer.expert_group_name = handles.ep_group_name
        for param in layer.router.parameters():
            mark_autoep_folding_router_parameter(param)

    def forward(self, layer, hidden_states: torch.Tensor):
        tp_group, lanes = self.handles.tp_group, self.tp_size
        bsz, seqlen, hdim = hidden_states.shape
        x = average_gradient_over_tp(hidden_states.reshape(-1, hdim), tp_group, lanes)
        top_scores, selected, counts = layer.router(x, layer.expert_bias)
        with torch.no_grad():
            layer.tokens_per_expert.add_(counts.to(layer.tokens_per_expert.dtype))
        top_scores = average_gradient_over_tp(top_scores, tp_group, lanes)
        payload, weights = self._payload(layer, top_scores, selected)
        if self.validate_routing:
            assert_tp_payload_consistent(payload, tp_group=tp_group, tp_size=lanes)
        local, ctx = partition_assignments(
            payload, tp_group=tp_group, tp_rank=dist.get_rank(tp_group), tp_size=lanes
        )
        rows = x[local.token_indices]
        if layer.score_apply == "pre":  # weighted before the experts (in fp32), as the unfolded layer does
            rows = (rows.float() * weights.index_select(0, ctx.local_indices)[:, None].float()).to(rows.dtype)
        share_counts = torch.bincount(local.expert_indices, minlength=layer.num_experts)
        results = layer._dispatch_and_run(rows, _Share(None, local.expert_indices, share_counts))
        # summed in fp32, as the unfolded combine does, then back to the activations' dtype
        restored = restore_combined(
            results.float(), ctx, tp_group=tp_group, validate_coverage=self.validate_routing
        )
        output = restored.to(hidden_states.dtype).reshape(bsz, seqlen, hdim)
        return layer._finish(output, x, hidden_states, hdim)

    @staticmethod
    def _payload(layer, top_scores: torch.Tensor, selected: torch.Tensor):
        """The assignments sorted by expert (stable), and the routing weight of each."""
        top_k = layer.top_k
        order = torch.argsort(selected.reshape(-1), stable=True)
        experts = selected.reshape(-1)[order]
        weights = top_scores.reshape(-1)[order]
        ranks = torch.div(experts, layer.num_local_experts, rounding_mode="floor")
        none = torch.zeros_like(experts, dtype=torch.bool)
        payload = RoutedAssignmentPayload(
            token_indices=torch.div(order, top_k, rounding_mode="floor"),
            expert_indices=experts,
            assignment_indices=assignment_ordinals_by_expert(experts),
            capacity_slots=order.remainder(top_k),
            # with "pre" the weights were applied before the experts: the combine only sums
            combine_weights=weights if layer.score_apply == "post" else torch.ones_like(weights.detach()),
            drop_mask=none,
            pad_mask=none.clone(),
            input_splits=torch.bincount(ranks, minlength=layer.ep_size).tolist(),
            output_splits=[],
            extra={"destination_ranks": ranks, "num_tokens": selected.shape[0]},
        )
        payload.output_splits = list(payload.input_splits)
        return payload, weights
