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

from shardspeed.module_inject import tp_uc_meta
from shardspeed.module_inject.tp_comm import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    group_size,
    reduce_from_tensor_parallel,
)

__all__ = [
    "GateUpPackLinearLayer",
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
    if part.tp_size == 1 and isinstance(full, nn.Parameter):
        # one rank: nothing to split, so the module's own parameter is kept (no copy; a ZeRO-3 partitioned
        # parameter, whose local data is empty, keeps its partitioning as is)
        full.tp_partition = part
        return full
    param = nn.Parameter(shard_tensor(full.detach(), part, rank).clone(), requires_grad=requires_grad)
    param.tp_partition = part
    return param


def _whole_shape(param) -> tuple:
    """A parameter's shape before ZeRO-3 partitioned it (`ds_shape`), else its shape."""
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def _segments_from_shape(module: nn.Module, options: dict):
    """DeepSpeed's sub-parameter `shape` (`(parts, -1)` or `((q, k, v), -1)`) split along `partition_dim` 0 of
    a column layer's weight, as the fused parts' sizes (None without a shape). Taken out of `options`."""
    shape, dim = options.pop("shape", None), options.pop("partition_dim", 0)
    if shape is None:
        return None
    if dim not in (0, None):
        raise ValueError(f"partition_dim={dim!r}: a column layer's sub-parameters are split along dim 0")
    parts = tuple(shape[0]) if isinstance(shape[0], (list, tuple)) else shape[0]
    size = _whole_shape(module.weight)[1 if type(module).__name__ == "Conv1D" else 0]
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
        name, gather, spec = None, False, None
        if isinstance(weight, nn.Module):  # DeepSpeed's form: the second positional argument is mp_group
            module, group = weight, deepspeed_options.pop("mp_group", bias)
            name = deepspeed_options.pop("name", None)
            segments = None
            if isinstance(self, LinearLayer):
                gather = bool(deepspeed_options.pop("gather_output", False))
                spec = deepspeed_options.get("shape")
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
        local = _whole_shape(weight)  # this rank's shape (a ZeRO-3 partitioned parameter: its ds_shape)
        self.in_features, self.out_features = local[in_dim], local[out_dim]
        self._init_uc_layout(spec)

    # -- universal-checkpoint metadata (module_inject/tp_uc_meta.py) ------------------------------------------
    # DeepSpeed's names: `_orig_weight_shape` / `_orig_bias_shape` (whole shapes), `_partition_sizes` (each
    # rank's width along the split dimension), `_subparam_sizes` / `_subparam_shard_widths` (fused parts and
    # each rank's width of each), `_freeze_partition_sizes`, `_mark_uc_metadata`.
    partition_dim = 0  # the weight dimension split over the ranks (set per instance)

    def _init_uc_layout(self, spec) -> None:
        part = getattr(self.weight, "tp_partition", None)
        self.partition_dim = part.dim if part is not None else 0
        self._orig_weight_shape = self._whole(self.weight)
        self._orig_bias_shape = self._whole(self.bias) if self.bias is not None else None
        segments = (
            tuple(part.segments) if part is not None else (self._orig_weight_shape[self.partition_dim],)
        )
        self._subparam_sizes = segments if len(segments) > 1 else None
        if self._subparam_sizes is not None and spec is None:  # fused by AutoTP: the parts at the split dim
            spec = list(self._orig_weight_shape)
            spec[self.partition_dim] = segments
        self._subparam_shape_spec = spec
        self._freeze_partition_sizes(self._orig_weight_shape[self.partition_dim])
        self._mark_uc_metadata()

    def _whole(self, param) -> tuple:
        """The whole (unsplit) shape of one of this layer's parameters."""
        part = getattr(param, "tp_partition", None)
        shape = list(_whole_shape(param))
        if part is not None and part.tp_size > 1 and len(shape) > part.dim:
            shape[part.dim] = sum(part.segments)
        return tuple(shape)

    def _freeze_partition_sizes(self, total_size: int) -> tuple:
        """Each rank's width of the split dimension (`total_size` whole) at this layer's tensor degree, fused
        parts split one by one; recorded once, read by the metadata."""
        if self._subparam_sizes is not None:
            self._subparam_shard_widths = tp_uc_meta.subparam_shard_widths(
                self._subparam_sizes, self.tp_world_size
            )
            self._partition_sizes = tuple(sum(w[r] for w in self._subparam_shard_widths)
                                          for r in range(self.tp_world_size))  # fmt: skip
        else:
            self._subparam_shard_widths = None
            self._partition_sizes = tuple(tp_uc_meta.even_split(total_size, self.tp_world_size))
        return self._partition_sizes

    def _subparam_spec_for(self, whole_shape: tuple):
        """The fused parts' shape spec for a parameter of `whole_shape` (the bias: its one dimension)."""
        spec = self._subparam_shape_spec
        if spec is None:
            return None
        return tuple(spec)[: len(whole_shape)] if len(whole_shape) < len(tuple(spec)) else tuple(spec)

    def _mark_uc_metadata(self) -> None:
        raise NotImplementedError

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
        part = TPPartition(out_dim, tuple(segments or (_whole_shape(weight)[out_dim],)), tp)
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

    def _mark_uc_metadata(self) -> None:
        """Column-parallel: weight and bias split along the output features (part by part when fused)."""
        for param, whole, is_bias in ((self.weight, self._orig_weight_shape, False),
                                      (self.bias, self._orig_bias_shape, True)):  # fmt: skip
            if param is None:
                continue
            dim = 0 if is_bias else self.partition_dim
            fused = self._subparam_sizes is not None
            tp_uc_meta.set_param_uc_meta(
                param,
                partition_type="column",
                partition_dim=dim,
                logical_shape=whole,
                output_shape=(whole[dim],),
                sub_param_shape=self._subparam_spec_for(whole) if fused else None,
                sub_param_sizes=self._subparam_sizes,
                sub_param_shard_widths=self._subparam_shard_widths,
                partition_sizes=None if fused else self._partition_sizes,
                target_partition_shape=tuple(param.shape),
                original_shape=whole,
                is_bias=is_bias,
            )

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


class GateUpPackLinearLayer(LinearLayer):
    """A column layer over a packed `[gate; up]` projection (DeepSpeed's `GateUpPack_LinearLayer`): the two
    halves are split separately, so each rank holds its slice of both. `GateUpPackLinearLayer(module,
    mp_group, name=None)`."""

    def __init__(self, module: nn.Module, mp_group=None, **options):
        if "shape" in options:
            raise TypeError("GateUpPackLinearLayer: shape is fixed (two equal halves of the output features)")
        transposed = type(module).__name__ == "Conv1D"
        whole = _whole_shape(module.weight)
        out, inputs = (whole[1], whole[0]) if transposed else (whole[0], whole[1])
        if out % 2:
            raise ValueError(
                f"GateUpPackLinearLayer: {out} output features do not split into gate and up halves"
            )
        super().__init__(module, mp_group, shape=((out // 2, out // 2), inputs), **options)


class LinearAllreduce(_TPLinear):
    """Row-parallel linear: this rank's input features; outputs summed over the group, bias added once."""

    @staticmethod
    def _shard_module(module: nn.Module, group, rank: int, transposed: bool):
        weight = module.weight
        in_dim = 0 if transposed else 1
        part = TPPartition(in_dim, (_whole_shape(weight)[in_dim],), group_size(group))
        part.check(f"{type(module).__name__} (row-parallel input features)")
        w = _sharded_parameter(weight, part, rank, weight.requires_grad)
        bias = getattr(module, "bias", None)
        b = bias
        if bias is not None and part.tp_size > 1:  # whole on every rank: this rank's own copy
            b = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return w, b

    @classmethod
    def from_module(cls, module: nn.Module, group, rank: int, transposed: bool = False):
        return cls(*cls._shard_module(module, group, rank, transposed), group, transposed)

    def _mark_uc_metadata(self) -> None:
        """Row-parallel: the weight split along its input features; the bias whole on every rank."""
        whole = self._orig_weight_shape
        tp_uc_meta.set_param_uc_meta(
            self.weight,
            partition_type="row",
            partition_dim=self.partition_dim,
            logical_shape=whole,
            output_shape=(whole[1 - self.partition_dim],),
            partition_sizes=self._partition_sizes,
            target_partition_shape=tuple(self.weight.shape),
            original_shape=whole,
        )
        if self.bias is not None:
            bias = self._orig_bias_shape
            tp_uc_meta.set_param_uc_meta(
                self.bias,
                partition_type="row",
                logical_shape=bias,
                output_shape=bias,
                original_shape=bias,
                is_bias=True,
                replicated=True,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tensor_parallel(self._matmul(x), self.tp_group)
        return out + self.bias if self.bias is not None else out
