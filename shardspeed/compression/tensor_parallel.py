"""Compression layers split by AutoTP (``tensor_parallel.autotp_size`` > 1): the same techniques on shards.

When AutoTP replaces a ``LinearLayer_Compress`` by a column- or row-parallel layer, the replacement becomes
``TPCompressedColumn`` / ``TPCompressedRow``: module_inject's layer plus ``Compressible``, carrying the
source layer's techniques, masks and scores. Each rank computes what its slice of the unsplit layer would:

* masks stay full-size on every rank (l1 buffers as computed before the split, topk scores as replicated
  parameters) and each rank multiplies its slice (``_local``). Scores pass through
  ``copy_to_tensor_parallel``, so their gradient is summed over the group and stays replicated;
* quantization groups must be whole rows or whole runs within a row. A column layer's groups of several
  rows take their statistics from every rank's rows (an all-gather of per-row statistics); a row layer's
  groups span every rank's columns (an all-reduce of max / min / sums). Groups inside one rank's slice
  need no communication;
* a row layer's input is split over the group, so dynamic and static activation ranges are all-reduced.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardspeed.module_inject.layers import (
    LinearAllreduce,
    LinearLayer,
    TPPartition,
    gather_shards,
    shard_tensor,
)
from shardspeed.module_inject.tp_comm import copy_to_tensor_parallel, reduce_from_tensor_parallel

from .compressible import Compressible

__all__ = ["TPCompressedColumn", "TPCompressedRow", "to_tensor_parallel"]

_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
_REDUCE = {"max": lambda t: t.amax(dim=1), "min": lambda t: t.amin(dim=1), "sum": lambda t: t.sum(dim=1)}


class _AllReduce:
    """A ``Reduce`` over a process group (statistics of groups split over its ranks)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=_OPS[op], group=self.group)
        return out


class _RowGroupsAcrossRanks:
    """Column layer, groups of ``rows_per_group`` whole rows of the unsplit weight: per-row statistics of
    every rank are gathered into the unsplit order, reduced per group, and this rank's rows read back."""

    def __init__(self, group, rows: TPPartition, rank: int, rows_per_group: int):
        self.group, self.rows, self.rank, self.rows_per_group = group, rows, rank, rows_per_group

    def __call__(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        pieces = [torch.empty_like(tensor) for _ in range(self.rows.tp_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        full = gather_shards(pieces, self.rows).view(-1, self.rows_per_group)
        per_group = _REDUCE[op](full).view(-1, 1).expand(-1, self.rows_per_group).reshape(-1, 1)
        return shard_tensor(per_group, self.rows, self.rank)


class _TPCompressed(Compressible):
    def _adopt(self, source: Compressible, rank: int) -> None:
        self._init_compression()
        self.rank = rank
        self._setup_reduces()
        for name in ("weight_quantization_enabled_in_forward", "sparse_pruning_method", "row_pruning_method",
                     "head_pruning_method", "activation_quantization_method", "weight_quantization_enabled",
                     "activation_quantization_enabled", "sparse_pruning_enabled", "row_pruning_enabled",
                     "head_pruning_enabled", "num_heads", "activation_quantization", "sparse_pruning_ratio",
                     "row_pruning_ratio", "head_pruning_ratio", "activation_quantization_bits"):  # fmt: skip
            if hasattr(source, name):
                setattr(self, name, getattr(source, name))
        for mask_name, scores_name in self._MASK_NAMES.values():
            if mask_name in source._buffers:
                self.register_buffer(mask_name, source._buffers[mask_name])
            if scores_name in source._parameters:
                setattr(self, scores_name, source._parameters[scores_name])
        if isinstance(getattr(source, "activation_quantizer", None), torch.nn.Module):
            self.activation_quantizer = source.activation_quantizer
        if source.weight_quantization is not None:
            self.weight_quantization = copy.copy(source.weight_quantization)
            self._split_groups(source)
        self.full_in_features, self.full_out_features = source.in_features, source.out_features

    def _setup_reduces(self) -> None:
        """Column layers read the whole input; TPCompressedRow all-reduces input statistics."""

    def _scores(self, scores: torch.Tensor) -> torch.Tensor:
        return copy_to_tensor_parallel(scores, self.tp_group)

    def _unsupported_groups(self, source, why: str) -> ValueError:
        groups = self.weight_quantization.groups
        return ValueError(
            f"compression_training.weight_quantization.shared_parameters.quantize_groups: {groups} groups of a "
            f"{tuple(source.weight.shape)} weight split over {self.tp_world_size} tensor ranks: {why}"
        )


class TPCompressedColumn(_TPCompressed, LinearLayer):
    """A compressed column-parallel linear: this rank's output rows."""

    def _rows(self) -> TPPartition:
        return TPPartition(0, self.weight.tp_partition.segments, self.tp_world_size)

    def _local(self, full: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "heads":
            return full
        return shard_tensor(full, self._rows(), self.rank)

    def _split_groups(self, source) -> None:
        wq, out = self.weight_quantization, source.out_features
        if wq.groups % out == 0:  # runs inside rows: all on this rank
            wq.groups = self.weight.shape[0] * (wq.groups // out)
        elif out % wq.groups == 0:
            per_group, wq.groups = out // wq.groups, self.weight.shape[0]
            self._weight_reduce = _RowGroupsAcrossRanks(self.tp_group, self._rows(), self.rank, per_group)
        else:
            raise self._unsupported_groups(source, "groups must be whole rows or equal runs within rows")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight()
        copy_in = self.input_copy if self.input_copy is not None else copy_to_tensor_parallel
        out = F.linear(self.quantize_input(copy_in(x, self.tp_group)), weight)
        return out + bias if bias is not None else out


class TPCompressedRow(_TPCompressed, LinearAllreduce):
    """A compressed row-parallel linear: this rank's input columns; outputs summed over the group."""

    def _local(self, full: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "rows":
            return full
        if kind == "heads":
            return shard_tensor(full, TPPartition(0, (full.numel(),), self.tp_world_size), self.rank)
        return shard_tensor(full, TPPartition(1, (full.shape[1],), self.tp_world_size), self.rank)

    def _setup_reduces(self) -> None:
        self._input_reduce = _AllReduce(self.tp_group)  # the input is split over the group's ranks

    def _split_groups(self, source) -> None:
        wq, out, tp = self.weight_quantization, source.out_features, self.tp_world_size
        if out % wq.groups == 0:  # groups of whole rows: their columns are on every rank
            self._weight_reduce = _AllReduce(self.tp_group)
        elif wq.groups % out == 0 and (wq.groups // out) % tp == 0:
            wq.groups //= tp  # equal runs within rows, each on one rank
        else:
            raise self._unsupported_groups(source, "runs within a row must not straddle two ranks")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight()
        out = reduce_from_tensor_parallel(F.linear(self.quantize_input(x), weight), self.tp_group)
        return out + bias if bias is not None else out


def to_tensor_parallel(source: Compressible, tp_layer: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``tp_layer`` (AutoTP's split of ``source``) turned into its compressed variant, in place."""
    if getattr(tp_layer, "transposed", False):
        raise ValueError(
            "compressed layers split by AutoTP must be nn.Linear (convert Conv1D with convert_conv1d_to_linear)"
        )
    if getattr(source, "channel_pruning_method", None) is not None:
        raise ValueError("channel pruning applies to Conv2d layers, which AutoTP does not split")
    if source.head_pruning_method is not None and isinstance(tp_layer, LinearLayer):
        raise ValueError(
            "head pruning prunes the attention output matrix's inputs; AutoTP splits that matrix by rows"
        )
    tp_layer.__class__ = TPCompressedColumn if isinstance(tp_layer, LinearLayer) else TPCompressedRow
    tp_layer._adopt(source, rank)
    if source.head_pruning_method is not None and source.num_heads % tp_layer.tp_world_size:
        raise ValueError(
            f"head pruning: num_heads {source.num_heads} is not divisible by the tensor-parallel size"
        )
    return tp_layer
