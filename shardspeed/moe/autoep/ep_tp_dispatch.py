"""Splitting routed (token, expert) assignments across tensor lanes, and putting the results back
(DeepSpeed 0.19.8's `moe.ep_tp_dispatch`).

When expert parallelism is folded onto tensor parallelism (folding.py), the t ranks of a tensor group hold
the same tokens and route them identically. Sending every assignment from every lane would compute each
routed token t times, so each lane keeps a disjoint share before the expert all-to-all:

1. `assignment_ordinals_by_expert` numbers the assignments of each expert 0, 1, 2, ... (they are sorted by
   expert); `partition_assignments` keeps those whose ordinal is this lane's index modulo t, so each expert's
   work is dealt round-robin over the lanes, and returns what `restore_combined` needs.
2. After the experts ran, `restore_combined` all-gathers every lane's results over the tensor group and sums
   each token's top-k results weighted by their routing weights, one top-k slot at a time (the same order
   on every lane, whatever lane computed which slot), so every lane holds the full output.

Gradients: the gather's backward sums the lanes' output gradients and hands each lane its own rows, the
vector-Jacobian product of a gather whose output every lane consumes. When every lane computes the same loss
from that output, what lies before the gather (experts, routing weights) receives t times its gradient;
folding_grads.py and folded_layer.py say how that factor is removed. `average_gradient_over_tp` averages a
gradient over the tensor group (identity forward).

`assert_tp_payload_consistent` compares a digest of the assignments across the lanes: folding is only
correct when every lane routed identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "RestoreContext",
    "RoutedAssignmentPayload",
    "assert_tp_payload_consistent",
    "assignment_ordinals_by_expert",
    "average_gradient_over_tp",
    "dispatch_counters",
    "partition_assignments",
    "restore_combined",
]

# Two primes below 2**31 for the digest: a product of two residues stays below 2**62 (no int64 overflow).
_PRIME_A = 2147483647
_PRIME_B = 2147483629


@dataclass
class RoutedAssignmentPayload:
    """One row per (token, expert) assignment, sorted by expert. `assignment_indices`: the ordinal within its
    expert; `capacity_slots`: its top-k slot; `extra` may hold "destination_ranks" (the expert's rank, one
    per row) and "num_tokens"."""

    token_indices: torch.Tensor
    expert_indices: torch.Tensor
    assignment_indices: torch.Tensor
    capacity_slots: torch.Tensor
    combine_weights: torch.Tensor
    drop_mask: torch.Tensor
    pad_mask: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RestoreContext:
    """What `restore_combined` needs: the whole payload, the rows this lane kept, and counts for logs."""

    original_payload: RoutedAssignmentPayload
    local_indices: torch.Tensor
    tp_rank: int
    tp_size: int
    num_tokens: int
    counters: dict[str, int]


def assignment_ordinals_by_expert(expert_indices: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... within each run of equal expert ids: [0, 0, 2, 2, 2, 4] -> [0, 1, 0, 1, 2, 0]."""
    if expert_indices.numel() == 0:
        return expert_indices.to(torch.long)
    _, run_lengths = torch.unique_consecutive(expert_indices, return_counts=True)
    run_starts = torch.cumsum(run_lengths, 0) - run_lengths
    positions = torch.arange(expert_indices.numel(), device=expert_indices.device)
    return positions - torch.repeat_interleave(run_starts, run_lengths)


def _rows(payload: RoutedAssignmentPayload, indices: torch.Tensor) -> RoutedAssignmentPayload:
    """The payload restricted to rows `indices` (per-row tensors of `extra` too)."""
    rows = payload.token_indices.shape[0]
    extra = {
        key: value.index_select(0, indices) if torch.is_tensor(value) and value.dim() and value.shape[0] == rows
        else value
        for key, value in payload.extra.items()
    }  # fmt: skip
    pick = {
        name: getattr(payload, name).index_select(0, indices)
        for name in ("token_indices", "expert_indices", "assignment_indices", "capacity_slots",
                     "combine_weights", "drop_mask", "pad_mask")
    }  # fmt: skip
    return RoutedAssignmentPayload(
        **pick,
        input_splits=list(payload.input_splits),
        output_splits=list(payload.output_splits),
        extra=extra,
    )


def _num_tokens(payload: RoutedAssignmentPayload) -> int:
    value = payload.extra.get("num_tokens", 0)
    return int(value.item()) if torch.is_tensor(value) else int(value)


def partition_assignments(
    payload: RoutedAssignmentPayload, *, tp_group, tp_rank: int, tp_size: int
) -> tuple[RoutedAssignmentPayload, RestoreContext]:
    """This lane's share of the active (neither dropped nor padded) assignments: ordinal % tp_size == tp_rank.
    The share's `input_splits` are recounted from "destination_ranks" when the payload has them."""
    active = ~payload.drop_mask & ~payload.pad_mask
    keep = active if tp_size <= 1 else active & (payload.assignment_indices.remainder(tp_size) == tp_rank)
    local_indices = torch.nonzero(keep).flatten()
    local = _rows(payload, local_indices)
    destinations = local.extra.get("destination_ranks")
    if destinations is not None and payload.input_splits:
        ranks = len(payload.input_splits)
        local.input_splits = torch.bincount(destinations.to(torch.long), minlength=ranks)[:ranks].tolist()
    local.output_splits = list(local.input_splits)  # what arrives is known only after the count exchange
    counters = {
        "assignments_total": int(active.sum()),
        "assignments_local": int(local_indices.numel()),
        "padded": int(payload.pad_mask.sum()),
        "dropped": int(payload.drop_mask.sum()),
        "split_sum_in": sum(local.input_splits),
        "split_sum_out": sum(local.output_splits),
    }
    context = RestoreContext(payload, local_indices, tp_rank, tp_size, _num_tokens(payload), counters)
    return local, context


def dispatch_counters(ctx: RestoreContext) -> dict[str, int]:
    """A copy of the partition's counts (total / local assignments, padded, dropped, split sums)."""
    return dict(ctx.counters)


# -- the consistency check ---------------------------------------------------------------------------------


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """Integers standing for `tensor`'s values exactly: floats by their fp32 bit pattern."""
    tensor = tensor.detach().reshape(-1)
    if tensor.is_floating_point():
        return tensor.float().view(torch.int32).to(torch.long)
    return tensor.to(torch.long)


def _checksum(words: torch.Tensor, salt: int, prime: int) -> torch.Tensor:
    """sum(word_i * (i + salt)) mod prime: position-weighted, so reordered rows change it."""
    weights = torch.arange(salt, salt + words.numel(), device=words.device).remainder(prime)
    return (words.remainder(prime) * weights).remainder(prime).sum().remainder(prime)


def _digest(payload: RoutedAssignmentPayload) -> torch.Tensor:
    """[rows, sum of input splits, sum of output splits, checksum mod A, checksum mod B] of every field."""
    active = ~payload.drop_mask & ~payload.pad_mask
    device = payload.token_indices.device
    fields = [payload.token_indices, payload.expert_indices, payload.assignment_indices, payload.capacity_slots,
              payload.combine_weights, payload.drop_mask, payload.pad_mask, active]  # fmt: skip
    if torch.is_tensor(payload.extra.get("destination_ranks")):
        fields.append(payload.extra["destination_ranks"])
    digest = torch.tensor(
        [payload.token_indices.numel(), sum(payload.input_splits), sum(payload.output_splits), 0, 0],
        dtype=torch.long, device=device,
    )  # fmt: skip
    for number, tensor in enumerate(fields, start=1):
        words = _words(tensor)
        digest[3] = (digest[3] + _checksum(words, 1000 * number, _PRIME_A)).remainder(_PRIME_A)
        digest[4] = (digest[4] + _checksum(words, 7000 * number + 1, _PRIME_B)).remainder(_PRIME_B)
    return digest


def assert_tp_payload_consistent(payload: RoutedAssignmentPayload, *, tp_group, tp_size: int) -> None:
    """Raise RuntimeError unless every lane of `tp_group` holds the same assignments (two all-reduces of a
    5-number digest; nothing to check with one lane or no process group)."""
    if tp_size <= 1 or not dist.is_initialized():
        return
    digest = _digest(payload)
    highest, lowest = digest.clone(), digest.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=tp_group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=tp_group)
    if not torch.equal(highest, lowest):
        raise RuntimeError(
            "AutoEP+AutoTP routing decisions differ across tensor-parallel lanes: folded dispatch needs every "
            f"lane to route the same tokens identically (digest on this lane {digest.tolist()}, lowest "
            f"{lowest.tolist()}, highest {highest.tolist()})"
        )


# -- gathering the lanes' results ----------------------------------------------------------------------------


class _GatherRows(torch.autograd.Function):
    """Concatenate every lane's rows (their counts differ) on every lane; backward: sum the lanes' gradients
    and keep this lane's rows."""

    @staticmethod
    def forward(ctx, tensor, group, counts):
        ctx.group, ctx.counts = group, counts
        ctx.lane = dist.get_rank(group=group)
        widest = max(counts)
        padded = tensor.new_zeros((widest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        start = sum(ctx.counts[: ctx.lane])
        return total[start : start + ctx.counts[ctx.lane]], None, None


def _gather_rows(tensor: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    if tp_size <= 1 or not dist.is_initialized():
        return tensor
    count = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
    counts = [torch.empty_like(count) for _ in range(tp_size)]
    dist.all_gather(counts, count, group=group)
    return _GatherRows.apply(tensor, group, tuple(int(c) for c in counts))


def _check_coverage(payload: RoutedAssignmentPayload, gathered: torch.Tensor) -> None:
    """The gathered (token, expert, ordinal, slot) rows must be exactly the payload's active rows."""
    active = ~payload.drop_mask & ~payload.pad_mask
    expected = torch.stack([payload.token_indices[active], payload.expert_indices[active],
                            payload.assignment_indices[active], payload.capacity_slots[active]], dim=1).long()  # fmt: skip
    if gathered.shape[0] != expected.shape[0]:
        raise RuntimeError(
            f"AutoEP+AutoTP restore coverage mismatch: gathered assignment count {gathered.shape[0]} != "
            f"expected {expected.shape[0]}"
        )
    if gathered.numel() and not torch.equal(torch.unique(gathered, dim=0), torch.unique(expected, dim=0)):
        raise RuntimeError(
            "AutoEP+AutoTP restore coverage mismatch: the gathered assignments are not the routed ones"
        )


def restore_combined(
    local_combined: torch.Tensor, ctx: RestoreContext, *, tp_group, validate_coverage: bool = False
) -> torch.Tensor:
    """`[num_tokens, hidden]`: each token's results summed over its top-k slots, weighted, from every lane's
    rows (`local_combined`: this lane's results, in the order of `ctx.local_indices`)."""
    payload, rows = ctx.original_payload, ctx.local_indices
    outputs = _gather_rows(local_combined, tp_group, ctx.tp_size)
    weights = _gather_rows(payload.combine_weights.index_select(0, rows), tp_group, ctx.tp_size)
    tokens = _gather_rows(payload.token_indices.index_select(0, rows), tp_group, ctx.tp_size).long()
    slots = _gather_rows(payload.capacity_slots.index_select(0, rows), tp_group, ctx.tp_size).long()
    if validate_coverage:
        experts = _gather_rows(payload.expert_indices.index_select(0, rows), tp_group, ctx.tp_size)
        ordinals = _gather_rows(payload.assignment_indices.index_select(0, rows), tp_group, ctx.tp_size)
        _check_coverage(payload, torch.stack([tokens, experts.long(), ordinals.long(), slots], dim=1))
    num_tokens = ctx.num_tokens if ctx.num_tokens > 0 else int(payload.token_indices.max()) + 1
    output = local_combined.new_zeros((num_tokens, *local_combined.shape[1:]))
    if outputs.shape[0] == 0:
        return output
    weighted = outputs * weights.to(outputs.dtype).reshape(-1, *([1] * (outputs.dim() - 1)))
    # one top-k slot at a time: every lane adds a token's results in the same order, so all lanes agree bitwise
    for slot in torch.unique(slots).tolist():
        chosen = slots == slot
        output = output.index_add(0, tokens[chosen], weighted[chosen])
    return output


class _AverageOverLanes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.div_(dist.get_world_size(group=ctx.group)), None


def average_gradient_over_tp(tensor: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    """`tensor` unchanged; its gradient becomes the mean of the lanes' gradients (one all-reduce)."""
    if tp_size <= 1 or not dist.is_initialized() or not tensor.requires_grad:
        return tensor
    return _AverageOverLanes.apply(tensor, tp_group)
