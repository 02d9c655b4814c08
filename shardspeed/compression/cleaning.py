"""Cleaning a compressed layer (``redundancy_clean``): make the masks and quantization permanent.

Each ``fix_*`` does to the weight what the forward did (so the cleaned layer computes what the masked one
did) and drops the technique's masks and scores. With ``dim_reduction`` the pruned rows, heads or channels
are removed, and the related layer loses the matching input columns or channels.

Unlike DeepSpeed 0.18.9, whose cleaned weights are fp32 tensors holding quantized values (the model gets no
smaller), ``fix_weight_quantization`` keeps the integer codes next to the weight (``layer._codes``: codes,
and each element's scale and offset). Every later fix changes codes and weight alike — zeros where masked,
the same rows and columns removed — and ``redundancy_clean`` finally swaps the layer for a packed one
(packed.py) whose weight is those codes, bit-packed, with their group scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .quantizers import quantize_codes

__all__ = [
    "CodeTensors",
    "fix_channel_pruning",
    "fix_head_pruning",
    "fix_row_pruning",
    "fix_sparse_pruning",
    "fix_weight_quantization",
]


@dataclass
class CodeTensors:
    """The codes behind a cleaned quantized weight: ``weight == codes * scale + offset`` elementwise."""

    codes: torch.Tensor  # int16
    scale: torch.Tensor  # fp32
    offset: torch.Tensor | None  # fp32, asymmetric only
    bits: int

    def map(self, fn) -> None:
        """Apply an indexing or masking function to the codes and their scales alike."""
        self.codes, self.scale = fn(self.codes), fn(self.scale)
        if self.offset is not None:
            self.offset = fn(self.offset)

    def zero_where(self, keep: torch.Tensor) -> None:
        """Masked elements become the value 0: the code whose value is 0 (may fall outside the code range for
        an asymmetric group whose minimum is above 0; packing then keeps that layer in floating point)."""
        keep = keep.bool()
        zero_code = torch.zeros_like(self.codes)
        if self.offset is not None:
            zero_code = torch.round(-self.offset / self.scale).to(self.codes.dtype)
        self.codes = torch.where(keep, self.codes, zero_code)


def _replace_weight(layer: nn.Module, value: torch.Tensor, name: str = "weight") -> None:
    """A new parameter for a changed shape, keeping requires_grad (DeepSpeed kept start/target bits on it)."""
    old = getattr(layer, name)
    setattr(layer, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


def _drop(layer: nn.Module, kind: str) -> None:
    mask_name, scores_name = layer._MASK_NAMES[kind]
    for name in (mask_name, scores_name):
        if name in layer._buffers:
            del layer._buffers[name]
        if name in layer._parameters:
            del layer._parameters[name]
    setattr(layer, f"{kind}_pruning_method", None)
    setattr(layer, f"{kind}_pruning_enabled", False)


def _mask_in_place(layer: nn.Module, keep: torch.Tensor, bias_keep: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        layer.weight.mul_(keep.to(layer.weight.dtype))
        if bias_keep is not None and layer.bias is not None:
            layer.bias.mul_(bias_keep.to(layer.bias.dtype))
    if layer._codes is not None:
        layer._codes.zero_where(keep.expand_as(layer.weight))


def _check_full(layer: nn.Module) -> None:
    if getattr(layer, "tp_world_size", 1) > 1:
        raise ValueError(
            "redundancy_clean: this layer is split over a tensor-parallel group; gather the model first "
            "(shardspeed.module_inject.tp_state.tp_full_state_dict into an unsplit compressed model)"
        )
    numel = getattr(layer.weight, "ds_numel", None)
    if numel is not None and numel != layer.weight.numel():
        raise ValueError(
            "redundancy_clean: the weights are partitioned by ZeRO stage 3; clean a model holding full weights "
            "(load the consolidated checkpoint, e.g. from shardspeed-zero-to-fp32, into the compressed model)"
        )


@torch.no_grad()
def fix_weight_quantization(layer: nn.Module) -> None:
    """Quantize the weight for good at the layer's current bits (nearest rounding), keeping its codes."""
    wq = layer.weight_quantization
    if wq is None:
        return None
    _check_full(layer)
    codes = quantize_codes(layer.weight, wq.bits, wq.groups, wq.symmetric)
    layer.weight.copy_(codes.values(layer.weight.dtype))
    layer._codes = CodeTensors(
        codes.codes, codes.per_element(codes.scale), codes.per_element(codes.offset), codes.bits
    )
    layer.weight_quantization_enabled = False
    layer.weight_quantization_enabled_in_forward = False
    return None


@torch.no_grad()
def fix_sparse_pruning(layer: nn.Module) -> None:
    if layer.sparse_pruning_method is None:
        return None
    _check_full(layer)
    _mask_in_place(layer, layer.get_mask("sparse").detach())
    _drop(layer, "sparse")
    return None


def _reduce_rows(layer: nn.Module, keep: torch.Tensor) -> None:
    _replace_weight(layer, layer.weight.detach()[keep])
    if layer.bias is not None:
        _replace_weight(layer, layer.bias.detach()[keep], "bias")
    if layer._codes is not None:
        layer._codes.map(lambda t: t[keep])


def _reduce_columns(layer: nn.Module, keep: torch.Tensor) -> None:
    _replace_weight(layer, layer.weight.detach()[:, keep])
    if layer._codes is not None:
        layer._codes.map(lambda t: t[:, keep])


@torch.no_grad()
def fix_row_pruning(layer: nn.Module, mask=None, dim_reduction: bool = False):
    """Row-pruned layer (``mask`` None): returns its row mask. Related layer: drops the masked input columns."""
    _check_full(layer)
    if mask is not None:
        _reduce_columns(layer, mask.view(-1).bool())
        layer.in_features = layer.weight.shape[1]
        layer.row_pruning_enabled = False
        return None
    keep = layer.get_mask("row").detach().view(-1).bool()
    if dim_reduction:
        _reduce_rows(layer, keep)
        layer.out_features = layer.weight.shape[0]
    else:
        _mask_in_place(layer, keep.view(-1, 1), keep)
    _drop(layer, "row")
    return keep


@torch.no_grad()
def fix_head_pruning(layer: nn.Module, mask=None, num_heads=None, dim_reduction: bool = False):
    """Output matrix (``mask`` None): returns its head mask. q/k/v: drops the masked heads' output rows."""
    _check_full(layer)
    heads = num_heads or layer.num_heads
    if mask is not None:  # q, k or v: heads are groups of output rows
        keep = mask.view(-1).bool().repeat_interleave(layer.weight.shape[0] // heads)
        _reduce_rows(layer, keep)
        layer.out_features = layer.weight.shape[0]
        layer.head_pruning_enabled = False
        return mask
    keep = layer.get_mask("head").detach().view(-1).bool()
    columns = keep.repeat_interleave(layer.weight.shape[1] // heads)
    if dim_reduction:
        _reduce_columns(layer, columns)
        layer.in_features = layer.weight.shape[1]
    else:
        _mask_in_place(layer, columns.view(1, -1))
    _drop(layer, "head")
    return keep


@torch.no_grad()
def fix_channel_pruning(layer: nn.Module, mask=None, dim_reduction: bool = False):
    """Pruned Conv2d (``mask`` None): returns its channel mask. Related Conv2d: drops those input channels."""
    _check_full(layer)
    if mask is not None:
        _reduce_columns(layer, mask.view(-1).bool())
        layer.in_channels = layer.weight.shape[1]
        layer.channel_pruning_enabled = False
        return None
    keep = layer.get_mask("channel").detach().view(-1).bool()
    if dim_reduction:
        _reduce_rows(layer, keep)
        layer.out_channels = layer.weight.shape[0]
    else:
        _mask_in_place(layer, keep.view(-1, 1, 1, 1), keep)
    _drop(layer, "channel")
    return keep
