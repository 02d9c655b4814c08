"""`Experts`: the experts one rank holds, as copies of one expert module, each fed its slice of the tokens."""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["Experts"]


class Experts(nn.Module):
    """`num_local_experts` deep copies of `expert`. Each parameter is tagged as DeepSpeed tags it:
    `allreduce = False` (not reduced over the data-parallel group) and `group_name` (the expert group whose
    expert-data-parallel group reduces it instead)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for p in self.deepspeed_experts.parameters():
            p.allreduce = False
            p.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` (ranks, local experts, capacity, d_model): dim 1 is split, one slice per local expert."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]  # an expert may return (output, bias) as Megatron's MLPs do
            if out.shape != chunk.shape:
                raise ValueError(
                    f"expert {type(expert).__name__} returned shape {tuple(out.shape)} for an input of shape "
                    f"{tuple(chunk.shape)}: an MoE expert's output must have its input's shape"
                )
            outputs.append(out)
        return torch.cat(outputs, dim=1)
