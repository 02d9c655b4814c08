"""AutoEP's token-choice top-k router: each token picks its `top_k` experts by score.

Scores are the gate's softmax or sigmoid. With group-limited routing the experts form `num_expert_groups`
groups, each token keeps only its best `num_limited_groups` groups (ranked by the best expert score, "max", or
by the sum of the two best, "top2_sum") and chooses its experts among those. A DeepSeek-V3
`e_score_correction_bias` shifts the choice but not the weights. The chosen weights are optionally normalised
to sum to one (`route_norm`) and then multiplied by `route_scale`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TokenChoiceTopKRouter", "count_tokens_per_expert"]


def count_tokens_per_expert(selected_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, slot) assignments each expert received, as an int32 vector of length `num_experts`."""
    return torch.bincount(selected_experts.reshape(-1).to(torch.int64), minlength=num_experts).to(torch.int32)


class TokenChoiceTopKRouter(nn.Module):
    """Routes `(T, dim)` tokens; returns `(top_scores (T, k), selected_experts (T, k), tokens_per_expert (E,))`."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        num_expert_groups: int | None,
        num_limited_groups: int | None,
        top_k: int,
        score_func: str,
        route_norm: bool,
        route_scale: float,
        gate_bias: bool,
        group_score_func: str = "top2_sum",
    ) -> None:
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if group_score_func not in ("max", "top2_sum"):
            raise ValueError(f"group_score_func must be 'max' or 'top2_sum', got {group_score_func!r}")
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.group_score_func = group_score_func
        # Set (as a parameter or buffer) when the source model has one (DeepSeek-V3).
        self.e_score_correction_bias = None

    def _limit_to_groups(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores with every expert outside each token's best `num_limited_groups` groups set to -inf."""
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if limited is None or limited < 1:
            raise ValueError(f"num_limited_groups must be >= 1 when num_expert_groups is set, got {limited}")
        if self.num_experts % groups:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by num_expert_groups ({groups})"
            )
        per_group = self.num_experts // groups
        grouped = scores.view(-1, groups, per_group)
        if self.group_score_func == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            if per_group < 2:
                raise ValueError(f"top2_sum group scores need >= 2 experts per group, got {per_group}")
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, k=limited, dim=-1, sorted=False).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> tuple:
        logits = self.gate(x).to(torch.float32)
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=1)
        # The biases steer which experts are chosen; the weights stay the unbiased scores.
        choice = scores if expert_bias is None else scores + expert_bias
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.unsqueeze(0)
        if self.num_expert_groups is not None:
            choice = self._limit_to_groups(choice)
        selected = torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(1, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        return top_scores, selected, count_tokens_per_expert(selected, self.num_experts)
