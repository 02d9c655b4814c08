"""``Compressible``: what every compression layer shares — switching techniques on, and their forward effect.

A layer (basic_layer.py) mixes this in over ``nn.Linear``, ``nn.Conv2d`` or ``nn.Embedding``.
``enable_*`` (called by ``init_compression``) sets a technique up; the scheduler flips the matching
``*_enabled`` flag at its ``schedule_offset``; ``compressed_weight()`` is the weight (and bias) the forward
uses once flags are on:

    quantize (fake, straight-through)  ->  x sparse mask  ->  x row mask (weight rows and bias)
    ->  x head mask (input columns, per head)  ->  x channel mask (Conv2d output channels)

Masks and scores are full-size and live in the module: l1 masks are buffers (fixed at ``enable_*`` from the
weights then), topk scores are parameters the optimizer trains (the mask is their top ``dense_ratio``).
So checkpoints, ZeRO and ``model.to`` carry them like any other state. A tensor-parallel layer
(tensor_parallel.py) overrides ``_local`` (its slice of a full mask) and the two ``*_reduce`` hooks (group
statistics over its tensor group); here they are the identity. Cleaning (``fix_*``) is in cleaning.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import cleaning
from .quantizers import Reduce, quantize_activation, topk_mask
from .techniques import ActivationQuantization, WeightQuantization

__all__ = ["Compressible", "QuantAct"]


def _local_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    return tensor


class QuantAct(nn.Module):
    """Static-range activation quantizer: a running (min, max) of the inputs seen in training, momentum 0.95."""

    def __init__(self, act_range_momentum: float = 0.95, quant_mode: str = "symmetric"):
        super().__init__()
        self.act_range_momentum = act_range_momentum
        self.quant_mode = quant_mode
        self.register_buffer("x_min_max", torch.zeros(2))

    def forward(self, x: torch.Tensor, num_bits: int, reduce: Reduce = _local_reduce) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                low = reduce(x.detach().min().float().reshape(1), "min")
                high = reduce(x.detach().max().float().reshape(1), "max")
                current = torch.cat([low, high]).to(self.x_min_max.dtype)
                if self.x_min_max[0] == self.x_min_max[1]:  # first batch: start from its range
                    self.x_min_max.copy_(current)
                m = self.act_range_momentum
                self.x_min_max.mul_(m).add_((1 - m) * current)
        value_range = (self.x_min_max[0], self.x_min_max[1])
        return quantize_activation(x, num_bits, self.quant_mode == "symmetric", value_range=value_range)


class Compressible:
    """Mixin over a torch layer with ``weight`` (and ``bias``): techniques, flags, the compressed weight."""

    # the dimensions row/channel masks act on: output rows of a Linear, output channels of a Conv2d
    def _init_compression(self) -> None:
        self.weight_quantization: WeightQuantization | None = None
        self.activation_quantization: ActivationQuantization | None = None
        self.weight_quantization_enabled_in_forward = False
        self.sparse_pruning_method = self.row_pruning_method = self.head_pruning_method = None
        self.channel_pruning_method = self.activation_quantization_method = None
        self.weight_quantization_enabled = self.activation_quantization_enabled = False
        self.sparse_pruning_enabled = self.row_pruning_enabled = False
        self.head_pruning_enabled = self.channel_pruning_enabled = False
        self.num_heads = None
        self._codes = None  # set by fix_weight_quantization: the codes behind the cleaned weight

    # ---- tensor-parallel hooks (identity here) ------------------------------------------------------------
    _weight_reduce: Reduce = staticmethod(_local_reduce)
    _input_reduce: Reduce = staticmethod(_local_reduce)

    def _local(self, full: torch.Tensor, kind: str) -> torch.Tensor:
        """This layer's part of a full-size mask (``kind``: "weight", "rows" or "heads")."""
        return full

    # ---- switching techniques on (DeepSpeed's method names and arguments) ----------------------------------
    def enable_weight_quantization(self, start_bits, target_bits, quantization_period,
                                   weight_quantization_enabled_in_forward, quantization_type, num_groups,
                                   rounding="nearest", fp16_mixed=None, verbose=False):  # fmt: skip
        mixed = fp16_mixed if fp16_mixed is not None else {}
        if weight_quantization_enabled_in_forward:
            # 0.18.9's in-forward path quantizes at target_bits from the first enabled step; start_bits and the
            # period drive only MoQ's schedule (in forward false), so the schedule starts at its end here
            start_bits = target_bits
        self.weight_quantization = WeightQuantization(
            start_bits=start_bits, target_bits=target_bits, period=quantization_period,
            groups=self._quantize_groups(num_groups), symmetric=quantization_type == "symmetric",
            stochastic=rounding == "stochastic", mixed=bool(mixed.get("enabled", False)),
            change_ratio=float(mixed.get("quantize_change_ratio", 0.001)), verbose=verbose,
        )  # fmt: skip
        self.weight_quantization_enabled_in_forward = weight_quantization_enabled_in_forward

    def _quantize_groups(self, num_groups: int) -> int:
        return num_groups

    def enable_activation_quantization(self, bits, quantization_type, range_calibration):
        self.activation_quantization = ActivationQuantization(
            bits, quantization_type == "symmetric", range_calibration == "static"
        )
        self.activation_quantization_bits = bits
        self.activation_quantization_method = self.activation_quantization.method
        if range_calibration == "static":
            self.activation_quantizer = QuantAct(quant_mode=quantization_type).to(self.weight.device)

    def enable_sparse_pruning(self, ratio, method):
        self.sparse_pruning_ratio, self.sparse_pruning_method = ratio, method
        self._mask_source("sparse", method, self.weight.detach().abs(), tuple(self.weight.shape))

    def enable_row_pruning(self, ratio, method):
        self.row_pruning_ratio, self.row_pruning_method = ratio, method
        rows = self.weight.shape[0]
        norms = self.weight.detach().abs().reshape(rows, -1).sum(dim=1).view(rows, 1)
        self._mask_source("row", method, norms, (rows, 1))

    def enable_head_pruning(self, ratio, method, num_heads):
        if self.weight.shape[1] % num_heads:
            raise ValueError(
                f"head pruning: num_heads {num_heads} does not divide the {self.weight.shape[1]} input features"
            )
        self.num_heads, self.head_pruning_ratio, self.head_pruning_method = num_heads, ratio, method
        norms = self.weight.detach().abs().t().reshape(num_heads, -1).sum(dim=1).view(1, num_heads)
        self._mask_source("head", method, norms, (1, num_heads))

    def enable_channel_pruning(self, ratio, method):
        self.channel_pruning_ratio, self.channel_pruning_method = ratio, method
        channels = self.weight.shape[0]
        norms = self.weight.detach().abs().reshape(channels, -1).sum(dim=1).view(channels, 1, 1, 1)
        self._mask_source("channel", method, norms, (channels, 1, 1, 1))

    _MASK_NAMES = {  # pruning type -> (l1 mask buffer, topk scores parameter): DeepSpeed's attribute names
        "sparse": ("sparse_pruning_mask", "sparse_mask_scores"),
        "row": ("row_pruning_mask", "row_mask_scores"),
        "head": ("head_pruning_mask", "head_pruning_scores"),
        "channel": ("channel_pruning_mask", "channel_mask_scores"),
    }

    def _mask_source(self, kind: str, method: str, norms: torch.Tensor, shape: tuple) -> None:
        """l1: a fixed mask buffer from the norms now; topk: learnable scores (kaiming-uniform, as DeepSpeed)."""
        mask_name, scores_name = self._MASK_NAMES[kind]
        ratio = getattr(self, f"{kind}_pruning_ratio")
        if method == "l1":
            self.register_buffer(mask_name, topk_mask(norms.to(self.weight.dtype), ratio).detach())
        elif method == "topk":
            scores = torch.empty(shape, dtype=self.weight.dtype, device=self.weight.device)
            nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
            setattr(self, scores_name, nn.Parameter(scores))
        else:
            raise ValueError(f"{kind} pruning: method {method!r} is not one of 'l1', 'topk'")

    # ---- masks --------------------------------------------------------------------------------------------
    def get_mask(self, pruning_type: str = "row") -> torch.Tensor:
        """The full-size 0/1 mask of ``pruning_type`` ("sparse", "row", "head", "channel")."""
        method = getattr(self, f"{pruning_type}_pruning_method")
        mask_name, scores_name = self._MASK_NAMES[pruning_type]
        if method == "l1":
            return getattr(self, mask_name)
        if method == "topk":
            return topk_mask(
                self._scores(getattr(self, scores_name)), getattr(self, f"{pruning_type}_pruning_ratio")
            )
        raise ValueError(f"{pruning_type} pruning is not enabled on this layer")

    def _scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores

    def _active(self, kind: str) -> bool:
        return bool(getattr(self, f"{kind}_pruning_enabled") and getattr(self, f"{kind}_pruning_method"))

    # ---- the forward's weight and input -------------------------------------------------------------------
    def compressed_weight(self):
        """(weight, bias) as the forward uses them, every enabled technique applied. Masks made by
        ``init_compression`` before the engine casts the model are buffers, which keep their dtype under
        fp16/bf16 training (as DeepSpeed 0.19 keeps buffers): each is used in the weight's dtype."""
        weight, bias = self.weight, self.bias
        if self.weight_quantization_enabled and self.weight_quantization is not None:
            weight = self.weight_quantization.apply(weight, self._weight_reduce)
        if self._active("sparse"):
            weight = weight * self._local(self.get_mask("sparse"), "weight").to(weight.dtype)
        if self._active("row"):
            rows = self._local(self.get_mask("row").view(-1), "rows").to(weight.dtype)
            weight = weight * rows.view(-1, *[1] * (weight.dim() - 1))
            bias = bias * rows if bias is not None else None
        if self._active("head"):
            heads = self._local(self.get_mask("head").view(-1), "heads").to(weight.dtype)
            out = weight.shape[0]
            weight = (weight.view(out, heads.numel(), -1) * heads.view(1, -1, 1)).view(out, -1)
        if self._active("channel"):
            channels = self.get_mask("channel").view(-1).to(weight.dtype)
            weight = weight * channels.view(-1, 1, 1, 1)
            bias = bias * channels if bias is not None else None
        return weight, bias

    def _input_groups(self, x: torch.Tensor) -> int:
        """Dynamic activation ranges: one per token (Linear); Conv2d overrides (one per sample)."""
        return x.numel() // x.shape[-1]

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        aq = self.activation_quantization
        if not (self.activation_quantization_enabled and aq is not None):
            return x
        if aq.static:
            return self.activation_quantizer(x, aq.bits, self._input_reduce)
        return quantize_activation(x, aq.bits, aq.symmetric, self._input_groups(x), reduce=self._input_reduce)

    # ---- cleaning (DeepSpeed's method names; cleaning.py does the work) ----------------------------------
    def fix_weight_quantization(self):
        return cleaning.fix_weight_quantization(self)

    def fix_sparse_pruning_helper(self):
        return cleaning.fix_sparse_pruning(self)

    def fix_row_col_pruning_helper(self, mask=None, dim_reduction=False):
        return cleaning.fix_row_pruning(self, mask, dim_reduction)

    def fix_head_pruning_helper(self, mask=None, num_heads=None, dim_reduction=False):
        return cleaning.fix_head_pruning(self, mask, num_heads, dim_reduction)

    def fix_channel_pruning_helper(self, mask=None, dim_reduction=False):
        return cleaning.fix_channel_pruning(self, mask, dim_reduction)

    def compression_extra_repr(self) -> str:
        wq = self.weight_quantization
        return (
            f"sparse pruning={self.sparse_pruning_method is not None}, row pruning={self.row_pruning_method is not None}, "
            f"head pruning={self.head_pruning_method is not None}, "
            f"activation quantization={self.activation_quantization_method is not None}, "
            f"weight_quantization={wq.bits if wq is not None else None}"
        )
