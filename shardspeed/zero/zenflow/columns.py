"""ZenFlow's view of ZeRO 1-2 buckets by columns: which columns matter, and their gradients, from shards.

A 2-D parameter (rows, columns) — a Linear weight is (out, in) — is split by columns: each column's
importance is the L1 norm of its gradient, and the top `topk_ratio` of them are the *selected* columns the
device updates at every step. Every other parameter (1-D biases and norms, and any other rank) is *whole*:
always updated at every step, as DeepSpeed does with 1-D parameters.

After a ZeRO 1-2 backward each rank holds only its shard of every bucket's averaged gradient. Both
collectives here are single all-reduces of small buffers in which each rank fills what its shard holds and
leaves zeros elsewhere, so the sum is the full value, bit for bit, on every rank (x + 0 is exact):
- `column_norms`: per 2-D parameter, the L1 norm of each column's gradient (one float per column);
- `selected_gradients`: the gradient of the selected columns (and of whole parameters), about `topk_ratio`
  of the model — where DeepSpeed broadcasts each owner's slice, this reduces once over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_reduce

__all__ = [
    "ColumnParam",
    "column_norms",
    "column_params",
    "selected_count",
    "selected_gradients",
    "shard_positions",
    "top_columns",
]


@dataclass
class ColumnParam:
    """One trainable parameter as ZenFlow sees it: where it is (bucket, index in the bucket), its name and
    logical shape, and whether it is split by columns (2-D) or whole."""

    bucket: int
    index: int
    name: str
    shape: tuple[int, ...]

    @property
    def by_columns(self) -> bool:
        return len(self.shape) == 2

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def column_params(buckets) -> list[ColumnParam]:
    """Every parameter of `buckets`, in bucket order."""
    return [
        ColumnParam(b, i, name, tuple(shape))
        for b, bucket in enumerate(buckets)
        for i, (name, shape) in enumerate(zip(bucket.names, bucket.shapes))
    ]


def selected_count(columns: int, topk_ratio: float) -> int:
    """How many of `columns` are selected: at least one (DeepSpeed's rule, int() rounding down)."""
    return max(1, int(columns * topk_ratio)) if columns else 0


def _fragment_of(bucket, index: int):
    """(start in the parameter, start in the shard, length) of parameter `index` inside this rank's shard."""
    for i, _, in_param, in_shard, length in bucket.fragments():
        if i == index:
            return in_param, in_shard, length
    return None


def _reduced(parts: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Sum `parts` over the group in one all-reduce of their concatenation; the summed parts back."""
    if not parts:
        return []
    flat = torch.cat([p.reshape(-1) for p in parts])
    if dist.get_world_size(group) > 1:
        all_reduce(flat, group=group)
    return list(torch.split(flat, [p.numel() for p in parts]))


def column_norms(
    params: list[ColumnParam], buckets, shards: list[torch.Tensor], group
) -> dict[str, torch.Tensor]:
    """Per 2-D parameter, the L1 norm of each column of its averaged gradient (fp32, on the shards' device)."""
    split = [p for p in params if p.by_columns]
    parts = []
    for p in split:
        shard = shards[p.bucket]
        sums = torch.zeros(p.shape[1], dtype=torch.float32, device=shard.device)
        found = _fragment_of(buckets[p.bucket], p.index)
        if found is not None:
            in_param, in_shard, length = found
            cols = torch.arange(in_param, in_param + length, device=shard.device) % p.shape[1]
            sums.index_add_(0, cols, shard[in_shard : in_shard + length].float().abs())
        parts.append(sums)
    return {p.name: total for p, total in zip(split, _reduced(parts, group))}


def top_columns(norms: dict[str, torch.Tensor], topk_ratio: float, group) -> dict[str, torch.Tensor]:
    """The selected columns of each 2-D parameter, ascending. Every rank computes the same from the same
    norms; rank 0's choice is broadcast anyway, so replicas can never diverge over a tie."""
    chosen = {}
    for name, sums in norms.items():
        k = selected_count(sums.numel(), topk_ratio)
        chosen[name] = torch.topk(sums, k).indices.sort().values
    if chosen and dist.get_world_size(group) > 1:
        flat = torch.cat(list(chosen.values()))
        dist.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        chosen = dict(zip(chosen, torch.split(flat, [v.numel() for v in chosen.values()])))
    return chosen


def selected_gradients(params: list[ColumnParam], buckets, shards: list[torch.Tensor],
                       selection: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:  # fmt: skip
    """The averaged gradient of each parameter's selected part: (rows, k) for a 2-D parameter, shaped as
    `param[:, selection[name]]`; the whole gradient for any other."""
    parts = []
    for p in params:
        shard = shards[p.bucket]
        found = _fragment_of(buckets[p.bucket], p.index)
        if p.by_columns:
            rows, cols = p.shape
            chosen = selection[p.name].to(shard.device)
            out = torch.zeros(rows, chosen.numel(), dtype=torch.float32, device=shard.device)
            if found is not None:
                in_param, in_shard, length = found
                slot = torch.full((cols,), -1, dtype=torch.long, device=shard.device)
                slot[chosen] = torch.arange(chosen.numel(), device=shard.device)
                element = torch.arange(in_param, in_param + length, device=shard.device)
                where = slot[element % cols]
                keep = where >= 0
                values = shard[in_shard : in_shard + length][keep].float()
                out[element[keep] // cols, where[keep]] = values
        else:
            out = torch.zeros(p.numel, dtype=torch.float32, device=shard.device)
            if found is not None:
                in_param, in_shard, length = found
                out[in_param : in_param + length] = shard[in_shard : in_shard + length].float()
        parts.append(out)
    reduced = _reduced(parts, group)
    return {p.name: value.view(part.shape) for p, value, part in zip(params, reduced, parts)}


def shard_positions(params: list[ColumnParam], bucket_index: int, bucket,
                    selection: dict[str, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """Positions, in this rank's shard of bucket `bucket_index`, of every element ZenFlow updates on the
    device (selected columns, whole parameters)."""
    positions = []
    for p in (p for p in params if p.bucket == bucket_index):
        found = _fragment_of(bucket, p.index)
        if found is None:
            continue
        in_param, in_shard, length = found
        local = torch.arange(length)
        if p.by_columns:
            chosen = torch.zeros(p.shape[1], dtype=torch.bool)
            chosen[selection[p.name].cpu()] = True
            local = local[chosen[(local + in_param) % p.shape[1]]]
        positions.append(local + in_shard)
    return torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
