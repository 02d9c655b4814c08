"""`AutoEPMoELayer`: a Hugging Face MoE block rebuilt expert-parallel.

Forward, for `(B, S, H)` hidden states on each of the `ep_size` ranks of an expert-parallel group:

1. route: the router gives every token its `top_k` experts and weights;
2. dispatch: the `T * top_k` (token, expert) assignments are sorted by expert; since expert `e` lives on rank
   `e // E_local`, that order is also by destination rank, so one all-to-all (sizes from `compute_split_plan`)
   sends each assignment's token to the rank owning its expert;
3. the received rows are regrouped by local expert and run through `GroupedExperts`;
4. combine: the inverse all-to-all brings each result back, and each token's `top_k` results are summed,
   weighted by the routing weights (`score_apply="post"`; with `"pre"` the inputs were weighted instead).

Shared experts (Qwen, DeepSeek) run on every rank as in the source block. Both all-to-alls are differentiable,
so gradients of a rank's experts come from every rank's tokens.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.moe.autoep import repack
from shardspeed.moe.autoep.config import AutoEPConfig, MoELayerSpec
from shardspeed.moe.autoep.experts import GroupedExperts
from shardspeed.moe.autoep.presets import resolve_autoep_config_defaults
from shardspeed.moe.autoep.router import TokenChoiceTopKRouter, count_tokens_per_expert

logger = logging.getLogger(__name__)

__all__ = [
    "AutoEPMoELayer",
    "RouterOutput",
    "SplitPlan",
    "apply_scores_before_experts_if_enabled",
    "combine_from_routed",
    "compute_split_plan",
    "compute_split_plan_from_expert_indices",
    "resolve_combine_impl",
    "resolve_score_apply_mode",
]


class RouterOutput(NamedTuple):
    top_scores: torch.Tensor  # [T, K]
    selected_experts: torch.Tensor  # [T, K]
    num_tokens_per_expert: torch.Tensor  # [E]


class SplitPlan(NamedTuple):
    """Rows this rank sends to / receives from each rank, and the received rows per (source rank, local expert)."""

    input_splits: list
    output_splits: list
    local_counts_by_source: torch.Tensor  # [ep_size, E_local]


def resolve_score_apply_mode(spec: MoELayerSpec, config_override: str) -> str:
    return spec.score_apply if config_override == "auto" else config_override


def resolve_combine_impl(config_override: str) -> str:
    return "weighted_sum" if config_override == "auto" else config_override


def apply_scores_before_experts_if_enabled(
    routed_input: torch.Tensor, top_scores: torch.Tensor, score_apply: str
) -> torch.Tensor:
    """With `score_apply="pre"` each routed row is weighted before its expert (in fp32); otherwise unchanged."""
    if score_apply != "pre":
        return routed_input
    return (routed_input.to(torch.float32) * top_scores.reshape(-1, 1)).to(routed_input.dtype)


def _plan_from_counts(counts: torch.Tensor, ep_size: int, num_local_experts: int, ep_group) -> SplitPlan:
    """One all-to-all of the `[ep_size, E_local]` count matrix: row `s` received is what rank `s` sends here."""
    matrix = counts.to(torch.int32).view(ep_size, num_local_experts)
    received = torch.empty_like(matrix.reshape(-1))
    dist.all_to_all_single(received, matrix.reshape(-1).contiguous(), group=ep_group)
    received = received.view(ep_size, num_local_experts)
    input_splits, output_splits = torch.stack((matrix.sum(dim=1), received.sum(dim=1))).tolist()
    return SplitPlan(input_splits, output_splits, received)


def compute_split_plan(
    selected_experts: torch.Tensor,
    num_experts: int,
    ep_size: int,
    num_local_experts: int,
    ep_group,
    num_tokens_per_expert: torch.Tensor | None = None,
) -> SplitPlan:
    """The all-to-all sizes for routing `selected_experts` (the router's histogram is reused when given)."""
    if num_tokens_per_expert is None:
        num_tokens_per_expert = count_tokens_per_expert(selected_experts, num_experts)
    if ep_size == 1:
        total = selected_experts.numel()
        return SplitPlan([total], [total], num_tokens_per_expert.view(1, num_local_experts))
    return _plan_from_counts(num_tokens_per_expert, ep_size, num_local_experts, ep_group)


def compute_split_plan_from_expert_indices(
    expert_indices: torch.Tensor, num_experts: int, ep_size: int, num_local_experts: int, ep_group
) -> SplitPlan:
    """The same plan for a flat list of assignments' expert ids."""
    return compute_split_plan(expert_indices, num_experts, ep_size, num_local_experts, ep_group)


class _AllToAllV(torch.autograd.Function):
    """Uneven all-to-all of rows; its gradient is the all-to-all back with the splits swapped."""

    @staticmethod
    def forward(ctx, group, x, input_splits, output_splits):
        ctx.group, ctx.input_splits, ctx.output_splits = group, input_splits, output_splits
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return None, back, None, None


def _order_by_local_expert(local_counts_by_source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows come grouped by (source rank, local expert); the stable order grouping them by local expert,
    and the per-expert row counts."""
    sources, local = local_counts_by_source.shape
    expert_of_row = torch.arange(local).repeat(sources)
    expert_of_row = torch.repeat_interleave(
        expert_of_row, local_counts_by_source.reshape(-1).to(torch.int64).cpu()
    )
    order = torch.argsort(expert_of_row, stable=True)
    return order, local_counts_by_source.sum(dim=0)


def combine_from_routed(
    expert_output: torch.Tensor,
    top_scores: torch.Tensor,
    token_indices_sorted: torch.Tensor,
    top_k: int,
    score_apply: str,
    combine_impl: str,
    shape: tuple,
) -> torch.Tensor:
    """Put each expert result back at its (token, slot) and sum a token's slots, weighted when `post`."""
    bsz, seqlen, hdim = shape
    tokens = bsz * seqlen
    slots = expert_output.new_zeros(tokens * top_k, hdim)
    slots[token_indices_sorted] = expert_output
    slots = slots.view(tokens, top_k, hdim)
    if score_apply == "post":
        weights = top_scores.reshape(tokens, top_k, 1).float()
        if combine_impl == "legacy_bmm":
            out = torch.bmm(weights.transpose(1, 2), slots.float()).squeeze(1)
        else:
            out = (slots.float() * weights).sum(dim=1)
        out = out.to(expert_output.dtype)
    else:
        out = slots.sum(dim=1)
    return out.reshape(bsz, seqlen, hdim)


def _copy_into(target: nn.Parameter, source: torch.Tensor) -> None:
    """Make `target` a copy of `source` (shape, dtype and device included)."""
    with torch.no_grad():
        target.data = source.detach().clone()


class AutoEPMoELayer(nn.Module):
    """The expert-parallel replacement of one MoE block (see the module docstring)."""

    _is_autoep_layer = True

    def __init__(
        self, spec: MoELayerSpec, source_module: nn.Module, ep_size: int, ep_rank: int, config: AutoEPConfig
    ) -> None:
        super().__init__()
        if spec.num_experts % ep_size:
            raise ValueError(f"num_experts={spec.num_experts} is not divisible by autoep_size={ep_size}")
        resolved = resolve_autoep_config_defaults(config, spec.model_family)
        if resolved.load_balance_coeff is not None:
            if not spec.supports_expert_bias:
                raise ValueError(
                    f"AutoEP preset '{spec.model_family}' does not support load_balance_coeff/expert_bias; "
                    "set load_balance_coeff=None."
                )
            raise ValueError(
                f"load_balance_coeff/expert_bias={resolved.load_balance_coeff!r} is not supported; set it to null"
            )
        if config.comm_backend != "comm":
            raise ValueError(f"comm_backend={config.comm_backend!r} is not built; use 'comm'")
        self.model_family = spec.model_family
        self.top_k = spec.top_k
        self.score_apply = resolve_score_apply_mode(spec, config.score_apply)
        self.combine_impl = resolve_combine_impl(config.combine_impl)
        if self.combine_impl not in ("weighted_sum", "legacy_bmm"):
            raise ValueError(
                f"combine_impl={self.combine_impl!r} is not built; use 'weighted_sum' or 'legacy_bmm'"
            )
        self.return_router_logits = spec.return_router_logits
        self.router_logits_capture_target = spec.router_logits_capture_target
        self.router_logits_capture_mode = spec.router_logits_capture_mode
        self.moe_output_shape = spec.moe_output_shape
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_experts = spec.num_experts
        self.num_local_experts = spec.num_experts // ep_size
        self.hidden_size = spec.hidden_size
        self.ep_group_name = f"ep_size_{ep_size}"
        self.expert_group_name = self.ep_group_name  # the name deepspeed.moe layers use for the same thing
        self.ep_group = (
            None  # set by set_deepspeed_parallelism (or directly) before a forward with ep_size > 1
        )
        # folded onto AutoTP (folded_layer.py): the FoldedDispatch, its group handles and tensor group
        self.folding = self.folding_group_handles = self.tp_group = None
        self.validate_folding_routing = config.validate_folding_routing
        self._build_router(spec, source_module)
        self._build_experts(spec, source_module, config)
        self.shared_experts = (
            getattr(source_module, spec.shared_experts_name, None) if spec.has_shared_experts else None
        )
        gate_name = spec.shared_experts_gate_name
        self.shared_experts_gate = getattr(source_module, gate_name, None) if gate_name else None
        self._mark_parameters()
        self.load_balance_coeff = None
        self.expert_bias = None
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(spec.num_experts, device=self.router.gate.weight.device),
            persistent=False,
        )

    def _build_router(self, spec: MoELayerSpec, source: nn.Module) -> None:
        gate = getattr(source, spec.router_name)
        gate_bias = getattr(gate, "bias", None)
        owner_path = spec.e_score_correction_bias_path
        owner = gate if owner_path is None else source.get_submodule(owner_path)
        correction = getattr(owner, "e_score_correction_bias", None)
        with repack.gathered_sources([gate.weight, gate_bias, correction]):
            self.router = TokenChoiceTopKRouter(
                spec.hidden_size, spec.num_experts, spec.num_expert_groups, spec.num_limited_groups, spec.top_k,
                spec.score_func, spec.route_norm, spec.route_scale, spec.gate_bias, spec.group_score_func,
            )  # fmt: skip
            _copy_into(self.router.gate.weight, gate.weight)
            self.router.gate.weight.requires_grad_(gate.weight.requires_grad)
            if spec.gate_bias and gate_bias is not None:
                _copy_into(self.router.gate.bias, gate_bias)
                self.router.gate.bias.requires_grad_(gate_bias.requires_grad)
            if correction is not None:
                self._copy_correction_bias(owner, correction)

    def _copy_correction_bias(self, owner: nn.Module, correction: torch.Tensor) -> None:
        """Keep DeepSeek-V3's score-correction bias as what it was in the source: a parameter or a buffer."""
        if isinstance(correction, nn.Parameter):
            self.router.e_score_correction_bias = nn.Parameter(
                correction.data.clone(), requires_grad=correction.requires_grad
            )
            return
        persistent = "e_score_correction_bias" not in owner._non_persistent_buffers_set
        del self.router.e_score_correction_bias
        self.router.register_buffer(
            "e_score_correction_bias", correction.detach().clone(), persistent=persistent
        )

    def _build_experts(self, spec: MoELayerSpec, source: nn.Module, config: AutoEPConfig) -> None:
        experts_source = getattr(source, spec.experts_name)
        weights = repack.repack_expert_weights(experts_source, spec, self.ep_rank, self.ep_size)
        flags = repack.repack_expert_requires_grad_flags(experts_source, spec, self.ep_rank, self.ep_size)
        self.experts = GroupedExperts(
            spec.hidden_size, spec.ffn_hidden_size, self.num_local_experts, use_grouped_mm=config.use_grouped_mm,
            disable_triton_grouped_mm=config.disable_triton_grouped_mm, activation=spec.expert_activation,
            activation_alpha=spec.expert_activation_alpha, activation_limit=spec.expert_activation_limit,
            gate_up_impl=config.gate_up_impl,
        )  # fmt: skip
        for param, weight, flag in zip((self.experts.w1, self.experts.w2, self.experts.w3), weights, flags):
            _copy_into(param, weight)
            param.requires_grad_(flag)

    def _mark_parameters(self) -> None:
        """Expert weights are per-rank (reduced over the expert-data-parallel group, as deepspeed.moe marks
        them); the router and shared experts are replicated."""
        for param in self.experts.parameters():
            param.allreduce = False
            param.group_name = self.ep_group_name
        for module in (self.router, self.shared_experts, self.shared_experts_gate):
            for param in module.parameters() if module is not None else ():
                param.allreduce = True

    def set_deepspeed_parallelism(
        self, use_data_before_expert_parallel_: bool = False, groups=None, folding_group_handles=None
    ) -> None:
        """Take the expert-parallel group from `groups` (what an engine built), or build it now (collective);
        with `folding_group_handles` (a `FoldingGroupHandles`), run folded onto those tensor lanes."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError("use_data_before_expert_parallelism=True is not supported")
        if folding_group_handles is not None:
            from shardspeed.moe.autoep.folded_layer import FoldedDispatch

            FoldedDispatch.bind(self, folding_group_handles)
            return
        if groups is None:
            from shardspeed.moe.groups import build_expert_groups

            groups = build_expert_groups([self.ep_size])
        group = groups[self.ep_group_name]
        self.ep_group, self.ep_rank = group.ep_group, group.ep_rank

    def _dispatch_and_run(self, routed: torch.Tensor, router_out: RouterOutput) -> torch.Tensor:
        if self.ep_size == 1:
            counts = router_out.num_tokens_per_expert
            return self.experts(routed, counts)
        if self.ep_group is None:
            raise RuntimeError(
                "AutoEPMoELayer with ep_size > 1 has no group: call set_deepspeed_parallelism()"
            )
        plan = compute_split_plan(
            router_out.selected_experts, self.num_experts, self.ep_size, self.num_local_experts, self.ep_group,
            router_out.num_tokens_per_expert,
        )  # fmt: skip
        received = _AllToAllV.apply(self.ep_group, routed, plan.input_splits, plan.output_splits)
        order, counts = _order_by_local_expert(plan.local_counts_by_source)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        output = self.experts(received[order], counts)[inverse]
        return _AllToAllV.apply(self.ep_group, output, plan.output_splits, plan.input_splits)

    def forward(self, hidden_states: torch.Tensor):
        if self.folding is not None:  # tensor lanes share the routed work (folded_layer.py)
            return self.folding.forward(self, hidden_states)
        bsz, seqlen, hdim = hidden_states.shape
        x = hidden_states.reshape(-1, hdim)
        router_out = RouterOutput(*self.router(x, self.expert_bias))
        with torch.no_grad():
            self.tokens_per_expert.add_(router_out.num_tokens_per_expert.to(self.tokens_per_expert.dtype))
        # Assignments in expert order (hence destination-rank order); index // top_k is the token.
        sorted_slots = torch.argsort(router_out.selected_experts.reshape(-1), stable=True)
        routed = x[sorted_slots // self.top_k]
        routed = apply_scores_before_experts_if_enabled(
            routed, router_out.top_scores.reshape(-1)[sorted_slots], self.score_apply
        )
        expert_output = self._dispatch_and_run(routed, router_out)
        output = combine_from_routed(
            expert_output, router_out.top_scores, sorted_slots, self.top_k, self.score_apply, self.combine_impl,
            (bsz, seqlen, hdim),
        )  # fmt: skip
        return self._finish(output, x, hidden_states, hdim)

    def _finish(self, output: torch.Tensor, x: torch.Tensor, hidden_states: torch.Tensor, hdim: int):
        """The source block's output tail: shared experts, flat output and router logits where it had them."""
        if self.moe_output_shape == "flat":
            output = output.reshape(-1, hdim)
        if self.shared_experts is not None:
            shared_input = (
                x
                if (self.moe_output_shape == "flat" or self.shared_experts_gate is not None)
                else hidden_states
            )
            shared = self.shared_experts(shared_input)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(shared_input)) * shared
            output = output + shared.reshape_as(output)
        if not self.return_router_logits:
            return output
        logits = self.router.gate(x) if self.router_logits_capture_target == "router" else None
        if logits is not None and self.router_logits_capture_mode == "post_score":
            scores = logits.float()
            scores = (
                torch.softmax(scores, dim=-1)
                if self.router.score_func == "softmax"
                else torch.sigmoid(scores)
            )
            logits = scores.to(logits.dtype)
        return output, logits
