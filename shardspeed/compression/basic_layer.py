"""DeepSpeed's compression layers (``deepspeed.compression.basic_layer``), built on ``Compressible``.

``init_compression`` swaps each ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` and ``nn.BatchNorm2d`` of a
model for these subclasses. ``from_module`` keeps the original ``Parameter`` objects (tied weights stay
tied, an optimizer built on them keeps working); DeepSpeed built new parameters sharing the old storage.
Before a technique is enabled a layer computes exactly what the original did.

``ColumnParallelLinear_Compress`` / ``RowParallelLinear_Compress`` are the Megatron-style (``mpu``) layers
of DeepSpeed's API: constructed from sizes, returning ``(output, bias)``. Models split by AutoTP get their
own tensor-parallel compressed layers instead (tensor_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardspeed.module_inject.tp_comm import copy_to_tensor_parallel, reduce_from_tensor_parallel

from .compressible import Compressible, QuantAct

__all__ = [
    "BNLayer_Compress",
    "ColumnParallelLinear_Compress",
    "Conv2dLayer_Compress",
    "Embedding_Compress",
    "LinearLayer_Compress",
    "QuantAct",
    "RowParallelLinear_Compress",
]


def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` (built on the meta device) takes over ``old``'s parameters and buffers, objects and all."""
    for name, param in old.named_parameters(recurse=False):
        new._parameters[name] = param
    for name, buffer in old.named_buffers(recurse=False):
        new._buffers[name] = buffer
    new.train(old.training)
    return new


class LinearLayer_Compress(Compressible, nn.Linear):
    """``nn.Linear`` with weight/activation quantization and sparse, row and head pruning."""

    def __init__(self, *kargs, bias=True, **kwargs):
        super().__init__(*kargs, bias=bias, **kwargs)
        self._init_compression()

    @classmethod
    def from_module(cls, old: nn.Linear) -> LinearLayer_Compress:
        new = cls(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
        return _adopt(new, old)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            + self.compression_extra_repr()
        )

    def tensor_parallel_variant(self, tp_layer: nn.Module, rank: int) -> nn.Module:
        """The layer AutoTP puts in this one's place: ``tp_layer``'s split, this layer's compression."""
        from .tensor_parallel import to_tensor_parallel

        return to_tensor_parallel(self, tp_layer, rank)

    def forward(self, input, skip_bias_add=False):
        weight, bias = self.compressed_weight()
        input = self.quantize_input(input)
        if skip_bias_add:  # the mpu layers add the bias after their all-reduce
            return F.linear(input, weight), bias
        return F.linear(input, weight, bias)


class Conv2dLayer_Compress(Compressible, nn.Conv2d):
    """``nn.Conv2d`` with weight/activation quantization and sparse and channel pruning."""

    def __init__(self, *kargs, **kwargs):
        super().__init__(*kargs, **kwargs)
        self._init_compression()

    @classmethod
    def from_module(cls, old: nn.Conv2d) -> Conv2dLayer_Compress:
        new = cls(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, old.dilation,
                  old.groups, old.bias is not None, old.padding_mode, device="meta")  # fmt: skip
        return _adopt(new, old)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", " + self.compression_extra_repr()

    def _input_groups(self, x: torch.Tensor) -> int:
        return x.shape[0] if x.dim() == 4 else 1  # one dynamic range per sample

    def forward(self, input):
        weight, bias = self.compressed_weight()
        return self._conv_forward(self.quantize_input(input), weight, bias)


class Embedding_Compress(Compressible, nn.Embedding):
    """``nn.Embedding`` with weight quantization, one group per token (as DeepSpeed forces)."""

    bias = None

    def __init__(self, *kargs, **kwargs):
        super().__init__(*kargs, **kwargs)
        self._init_compression()

    @classmethod
    def from_module(cls, old: nn.Embedding) -> Embedding_Compress:
        new = cls(old.num_embeddings, old.embedding_dim, old.padding_idx, old.max_norm, old.norm_type,
                  old.scale_grad_by_freq, old.sparse, device="meta")  # fmt: skip
        return _adopt(new, old)

    def _quantize_groups(self, num_groups: int) -> int:
        return self.num_embeddings  # token-wise, whatever quantize_groups says (DeepSpeed does the same)

    def extra_repr(self) -> str:
        wq = self.weight_quantization
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"weight_quantization={wq.bits if wq is not None else None}"
        )

    def forward(self, input):
        weight, _ = self.compressed_weight()
        return F.embedding(input, weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)  # fmt: skip


class BNLayer_Compress(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that follows the channel pruning of the Conv2d before it."""

    @classmethod
    def from_module(cls, old: nn.BatchNorm2d) -> BNLayer_Compress:
        new = cls(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats, device="meta")
        return _adopt(new, old)

    @torch.no_grad()
    def fix_channel_pruning_helper(self, mask, dim_reduction=True):
        keep = mask.view(-1).bool()
        if self.affine:
            self.weight = nn.Parameter(self.weight.detach()[keep], requires_grad=self.weight.requires_grad)
            self.bias = nn.Parameter(self.bias.detach()[keep], requires_grad=self.bias.requires_grad)
        if self.track_running_stats:
            self.running_mean = self.running_mean[keep]
            self.running_var = self.running_var[keep]
        self.num_features = int(keep.sum())


# ---- Megatron-style tensor-parallel layers (DeepSpeed's mpu API) -------------------------------------------


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _last_dim_slice(grad, ctx.group), None


class _ScatterLastDim(torch.autograd.Function):
    """This rank's slice of the last dimension forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _last_dim_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherLastDim.apply(grad, ctx.group), None


def _last_dim_slice(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _per_rank(mpu, size: int, what: str, layer: str) -> int:
    world = mpu.get_model_parallel_world_size()
    if size % world:
        raise ValueError(f"{layer}: {what} {size} is not divisible by the model-parallel size {world}")
    return size // world


class ColumnParallelLinear_Compress(LinearLayer_Compress):
    """Output features split over ``mpu``'s model-parallel group; returns ``(output, bias)``."""

    def __init__(self, mpu, input_size, output_size, bias=True, gather_output=True, skip_bias_add=False):
        self.output_size_per_partition = _per_rank(mpu, output_size, "output_size", type(self).__name__)
        super().__init__(input_size, self.output_size_per_partition, bias=bias)
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.tp_group = mpu.get_model_parallel_group()

    def forward(self, input_):
        parallel = copy_to_tensor_parallel(input_, self.tp_group)
        if self.skip_bias_add:
            output, bias = super().forward(parallel, True)
        else:
            output, bias = super().forward(parallel), None
        if self.gather_output and dist.get_world_size(self.tp_group) > 1:
            output = _GatherLastDim.apply(output, self.tp_group)
        return output, bias


class RowParallelLinear_Compress(LinearLayer_Compress):
    """Input features split over ``mpu``'s model-parallel group; returns ``(output, bias)``."""

    def __init__(self, mpu, input_size, output_size, bias=True, input_is_parallel=False, skip_bias_add=False):
        self.input_size_per_partition = _per_rank(mpu, input_size, "input_size", type(self).__name__)
        super().__init__(self.input_size_per_partition, output_size, bias=bias)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.tp_group = mpu.get_model_parallel_group()

    def forward(self, input_):
        parallel = input_
        if not self.input_is_parallel and dist.get_world_size(self.tp_group) > 1:
            parallel = _ScatterLastDim.apply(input_, self.tp_group)
        output, bias = super().forward(parallel, True)
        output = reduce_from_tensor_parallel(output, self.tp_group)
        if self.skip_bias_add:
            return output, bias
        return (output + bias if bias is not None else output), None
