"""Sparse routes: a gate's routing as (expert, slot, weight) per token and choice, and the dispatch by them.

A dense gate output is two (S, E, C) tensors (combine weights, dispatch mask) that are mostly zero; moving
tokens with them costs an einsum over S * E * C. DeepSpeed's gates can instead return, for each of the k
choices of each of the S tokens, the expert index (-1 where the capacity limit dropped the choice), the slot
in that expert's buffer and the gate weight (`sparse_routes=True`): (k, S) tensors. `route_slots` turns
them into one flat slot per choice, `sparse_encode` copies tokens into the (E, C, M) expert buffer and
`sparse_decode` reads the experts' outputs back, weighted: S * k * M elements moved, as they should be.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["route_slots", "sparse_decode", "sparse_encode", "sparse_routes"]


def sparse_routes(choices, capacity: int, num_experts: int, l_aux: Tensor, exp_counts: Tensor) -> tuple:
    """DeepSpeed's sparse gate output from per-choice (weight (S,), expert mask (S, E), slots (S, E)), the
    mask already cut to capacity: (l_aux, capacity, num_experts, indices, locations, gates, exp_counts)."""
    indices, locations, gates = [], [], []
    for weight, mask, slots in choices:
        kept = mask.any(dim=1)
        indices.append(torch.where(kept, mask.argmax(dim=1), torch.full_like(kept, -1, dtype=torch.long)))
        locations.append(torch.sum(slots * mask, dim=1))  # 0 for a dropped choice (its index is -1)
        gates.append(weight * kept.to(weight.dtype))
    stack = torch.stack
    return (l_aux, capacity, num_experts, stack(indices).to(torch.int32), stack(locations).to(torch.int32),
            stack(gates), exp_counts)  # fmt: skip


def route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The flat slot (expert * capacity + location) of every choice; a dropped choice gets the one spare slot
    past the end (`num_experts * capacity`), which encode and decode read as zeros."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, num_experts * capacity))


def sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """(S, M) tokens into the (E, C, M) expert buffer at `slots` (k, S); empty slots are zeros."""
    num_tokens, d_model = tokens.shape
    # which token fills each slot (num_tokens: none, read from a zero row); the spare slot takes every drop
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=slots.device)
    source.scatter_(
        0, slots.reshape(-1), torch.arange(num_tokens, device=slots.device).repeat(slots.shape[0])
    )
    padded = torch.cat([tokens, tokens.new_zeros(1, d_model)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, d_model)


def sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """Each token's sum over its choices of gate weight * its slot's output: (E * C, M) to (S, M). The sum runs
    in the gates' dtype (fp32 from the gate), so bf16/fp16 outputs lose no precision adding the choices."""
    d_model = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, d_model)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)
