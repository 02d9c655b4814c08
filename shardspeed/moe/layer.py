"""`MoE`: DeepSpeed's Mixture-of-Experts layer (`deepspeed.moe.layer.MoE`), optionally residual (PR-MoE)."""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.moe.experts import Experts
from shardspeed.moe.sharded_moe import _TUTEL_MESSAGE, MOELayer, TopKGate

__all__ = ["MoE"]


class MoE(nn.Module):
    """`num_experts` copies of `expert` spread over `ep_size` expert-parallel ranks, `k` experts per token.

    `forward(hidden_states, used_token=None)` returns `(output, l_aux, exp_counts)`; `output` has the input's
    shape. With `use_residual` the output mixes the experts' with a dense MLP (`expert` itself) by a learned,
    per-token softmax coefficient (Residual MoE).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):  # fmt: skip
        super().__init__()
        if ep_size < 1 or num_experts % ep_size != 0:
            raise ValueError(
                f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size}), so that every "
                "expert-parallel rank holds the same number of experts"
            )
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE: k={k} experts per token is more than num_experts={num_experts}")
        if use_tutel:
            raise NotImplementedError(_TUTEL_MESSAGE)
        if enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "MoE(enable_expert_tensor_parallelism=True) is not supported: experts are not tensor-parallel"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)  # fmt: skip
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # mixing weights: [experts, dense MLP]

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, groups=None) -> None:
        """Give the layer its expert-parallel group: from `groups` (what the engine built), or built now
        over the whole world (collective) when the layer is used without an engine."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError("use_data_before_expert_parallelism=True is not supported")
        if groups is None:
            from shardspeed.moe.groups import build_expert_groups

            groups = build_expert_groups([self.ep_size])
        self.deepspeed_moe._set_ep_group(groups[self.expert_group_name].ep_group)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
