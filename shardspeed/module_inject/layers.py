"""Tensor-parallel layers (DeepSpeed's `deepspeed.module_inject.layers` names) and the shard layout they use.

- `LinearLayer`: column-parallel linear. Holds rows `[r*out/tp, (r+1)*out/tp)` of the weight (and of the
  bias); its output stays split over the tensor group (the next row-parallel layer consumes it as is), or,
  with `gather_output`, is all-gathered whole on every rank (an untied LM head in a Hugging Face tp_plan).
- `LinearAllreduce`: row-parallel linear. Holds a slice of the input features; the partial products are
  summed over the tensor group in forward, then the (replicated) bias is added once.

Both keep the orientation of the layer they replace: a Hugging Face `Conv1D` (GPT-2, weight `[in, out]`,
`y = x @ W + b`) stays `[in, out]`, so state-dict names and layouts read like the original model's.

Every sharded parameter carries a `TPPartition` (`param.tp_partition`): the dimension it is split along and
the *segments* of that dimension. A fused projection (GPT-2's `c_attn` = [q; k; v], or a GQA `qkv_proj`
with unequal parts) has several segments, each split over the ranks separately, so that rank r holds
[q_r; k_r; v_r] and its attention heads stay whole. `shard_tensor` and `gather_shards` are the two
directions of that layout; checkpoints and `save_16bit_model` use them to merge or re-split weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardspeed.module_inject.tp_comm import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    group_size,
    reduce_from_tensor_parallel,
)

__all__ = [
    "LinearAllreduce",
    "LinearLayer",
    "SubParamLinearLayer",
    "TPPartition",
    "gather_shards",
    "shard_tensor",
]


@dataclass(frozen=True)
class TPPartition:
    """How a parameter is split over `tp_size` ranks: along `dim`, each of `segments` (full sizes) separately."""

    dim: int
    segments: tuple[int, ...]
    tp_size: int

    def check(self, what: str) -> None:
        bad = [s for s in self.segments if s % self.tp_size]
        if bad:
            raise ValueError(
                f"{what}: size {bad[0]} along dim {self.dim} (of segments {list(self.segments)}) is not "
                f"divisible by the tensor-parallel size {self.tp_size}"
            )

    def as_dict(self) -> dict:
        return {"dim": self.dim, "segments": list(self.segments), "tp_size": self.tp_size}


def shard_tensor(full: torch.Tensor, part: TPPartition, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of `full`: its slice of every segment along `part.dim`, concatenated."""
    pieces, offset = [], 0
    for size in part.segments:
        step = size // part.tp_size
        pieces.append(full.narrow(part.dim, offset + rank * step, step))
        offset += size
    return torch.cat(pieces, dim=part.dim) if len(pieces) > 1 else pieces[0]


def gather_shards(shards: list[torch.Tensor], part: TPPartition) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of `shard_tensor`)."""
    per_rank = [s // part.tp_size for s in part.segments]
    split = [shard.split(per_rank, dim=part.dim) for shard in shards]
    segments = [
        torch.cat([split[r][i] for r in range(len(shards))], dim=part.dim) for i in range(len(per_rank))
    ]
    return torch.cat(segments, dim=part.dim) if len(segments) > 1 else segments[0]


def _sharded_parameter(full: torch.Tensor, part: TPPartition, rank: int, requires_grad: bool) -> nn.Parameter:
    param = nn.Parameter(shard_tensor(full.detach(), part, rank).clone(), requires_grad=requires_grad)
    param.tp_partition = part
    return param


def _segments_from_shape(module: nn.Module, options: dict):
    """DeepSpeed's sub-parameter `shape` (`(parts, -1)` or `((q, k, v), -1)`) split along `partition_dim` 0 of
    a column layer's weight, as the fused parts' sizes (None without a shape). Taken out of `options`."""
    shape, dim = options.pop("shape", None), options.pop("partition_dim", 0)
    if shape is None:
        return None
    if dim not in (0, None):
        raise ValueError(f"partition_dim={dim!r}: a column layer's sub-parameters are split along dim 0")
    parts = tuple(shape[0]) if isinstance(shape[0], (list, tuple)) else shape[0]
    size = module.weight.shape[1 if type(module).__name__ == "Conv1D" else 0]
    if isinstance(parts, int):
        if parts < 1 or size % parts:
            raise ValueError(f"shape={shape!r}: {size} output features do not split into {parts} equal parts")
        return (size // parts,) * parts
    if sum(parts) != size:
        raise ValueError(f"shape={shape!r}: the parts do not add up to the {size} output features")
    return parts


class _TPLinear(nn.Module):
    """Shared state of the two parallel linears: the group, the orientation, local sizes.

    Built by AutoTP (`from_module`, or the shards directly: `Layer(weight, bias, group, transposed)`), or in
    DeepSpeed's form `Layer(module, mp_group=None, name=None)`, which shards the whole `module` (an
    `nn.Linear` or a Hugging Face `Conv1D`) for this rank of `mp_group` (None: one rank, nothing split).
    """

    def __init__(self, weight, bias=None, group=None, transposed: bool = False, **deepspeed_options):
        name, gather = None, False
        if isinstance(weight, nn.Module):  # DeepSpeed's form: the second positional argument is mp_group
            module, group = weight, deepspeed_options.pop("mp_group", bias)
            name = deepspeed_options.pop("name", None)
            segments = None
            if isinstance(self, LinearLayer):
                gather = bool(deepspeed_options.pop("gather_output", False))
                segments = _segments_from_shape(module, deepspeed_options)
            if deepspeed_options.pop("skip_partition", False):
                raise ValueError(
                    f"{type(self).__name__}(skip_partition=True): a module whose weight is already this rank's "
                    "shard is not supported; pass the whole module"
                )
            transposed = type(module).__name__ == "Conv1D"
            rank = dist.get_rank(group) if group_size(group) > 1 else 0
            shard_args = (segments,) if segments is not None else ()
            weight, bias = self._shard_module(module, group, rank, transposed, *shard_args)
        if deepspeed_options:
            raise TypeError(f"{type(self).__name__}: unsupported argument(s) {sorted(deepspeed_options)}")
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp_group = group
        self.tp_world_size = group_size(group)
        self.tp_index = dist.get_rank(group) if self.tp_world_size > 1 else 0  # DeepSpeed's name: this rank
        self.name = name
        if gather:
            self.gather_output = True
        self.transposed = transposed  # Conv1D orientation: weight is [in, out]
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        self.in_features, self.out_features = weight.shape[in_dim], weight.shape[out_dim]

    @property
    def mp_group(self):
        """DeepSpeed's name for the tensor group."""
        return self.tp_group

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight if self.transposed else F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (this rank), "
            f"bias={self.bias is not None}, tp={self.tp_world_size}, transposed={self.transposed}"
        )


class LinearLayer(_TPLinear):
    """Column-parallel linear: this rank's output features; the input's gradient is summed over the group."""

    @staticmethod
    def _shard_module(module: nn.Module, group, rank: int, transposed: bool, segments=None):
        weight = module.weight
        out_dim = 1 if transposed else 0
        tp = group_size(group)
        part = TPPartition(out_dim, tuple(segments or (weight.shape[out_dim],)), tp)
        part.check(f"{type(module).__name__} (column-parallel output features)")
        w = _sharded_parameter(weight, part, rank, weight.requires_grad)
        b = None
        if getattr(module, "bias", None) is not None:
            b = _sharded_parameter(
                module.bias, TPPartition(0, part.segments, tp), rank, module.bias.requires_grad
            )
        return w, b

    @classmethod
    def from_module(cls, module: nn.Module, group, rank: int, segments=None, transposed: bool = False):
        return cls(*cls._shard_module(module, group, rank, transposed, segments), group, transposed)

    input_copy = None  # a SharedInputCopy shared with sibling column layers (set by AutoTP), or None
    gather_output = False  # True: the output is all-gathered, every rank gets all features (one fused part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copy = self.input_copy if self.input_copy is not None else copy_to_tensor_parallel
        out = self._matmul(copy(x, self.tp_group))
        out = out + self.bias if self.bias is not None else out
        return gather_from_tensor_parallel(out, self.tp_group) if self.gather_output else out


class SubParamLinearLayer(LinearLayer):
    """DeepSpeed's name for a column layer whose fused sub-parameters (`shape`) are split separately:
    `SubParamLinearLayer(module, mp_group, shape=(3, -1), partition_dim=0)` is a `LinearLayer` with segments."""


class LinearAllreduce(_TPLinear):
    """Row-parallel linear: this rank's input features; outputs summed over the group, bias added once."""

    @staticmethod
    def _shard_module(module: nn.Module, group, rank: int, transposed: bool):
        weight = module.weight
        in_dim = 0 if transposed else 1
        part = TPPartition(in_dim, (weight.shape[in_dim],), group_size(group))
        part.check(f"{type(module).__name__} (row-parallel input features)")
        w = _sharded_parameter(weight, part, rank, weight.requires_grad)
        bias = getattr(module, "bias", None)
        b = (
            nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
            if bias is not None
            else None
        )
        return w, b

    @classmethod
    def from_module(cls, module: nn.Module, group, rank: int, transposed: bool = False):
        return cls(*cls._shard_module(module, group, rank, transposed), group, transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tensor_parallel(self._matmul(x), self.tp_group)
        return out + self.bias if self.bias is not None else out
