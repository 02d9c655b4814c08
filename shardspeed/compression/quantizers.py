"""The arithmetic of compression: weight and activation quantizers, top-k masks, straight-through estimators.

Weight quantization splits a tensor's flattened elements into ``groups`` equal runs (DeepSpeed's
``quantize_groups``) and gives each run one scale (and, asymmetric, one offset):

* ``bits >= 3``, symmetric: ``code in [-2^(b-1), 2^(b-1) - 1]``, ``scale = 2 * max|x| / 2^b``;
* ``bits >= 3``, asymmetric: ``code in [0, 2^b - 1]``, ``scale = (max - min) / 2^b``,
  ``offset = round(min / scale) * scale``;
* ``bits == 2`` (XTC's ternary): ``code in {-1, 0, 1}`` — elements above 0.7 x mean|x| keep their sign,
  ``scale`` = the mean |x| of those;
* ``bits == 1`` (binary): ``code = sign(x)``, ``scale = mean|x|``.

A value is ``code * scale + offset``, so a group holds at most ``2^bits`` distinct values: that is what the
packed format (packed.py) stores. These are DeepSpeed 0.18.9's formulas (its ``compression/utils.py`` and
``runtime/quantize.py``), computed in fp32 whatever the weight's dtype, with two guards it lacks: an
all-zero group gets scale 1 (codes 0) instead of NaNs, and a ternary group with nothing above the threshold
gets scale 0.

Statistics go through ``reduce(tensor, op)`` (op "max", "min" or "sum"), the identity by default: a
tensor-parallel layer passes an all-reduce over its tensor group, so a group split over ranks gets the same
scale as on one rank (tensor_parallel.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "Codes",
    "Reduce",
    "fake_quantize",
    "quantize_activation",
    "quantize_codes",
    "straight_through",
    "topk_mask",
]

Reduce = Callable[[torch.Tensor, str], torch.Tensor]


def _local(tensor: torch.Tensor, op: str) -> torch.Tensor:
    return tensor


@dataclass
class Codes:
    """A quantized tensor: ``values = codes * scale + offset`` per group (``codes`` has the tensor's shape)."""

    codes: torch.Tensor  # int16, same shape as the quantized tensor
    scale: torch.Tensor  # fp32, [groups, 1]
    offset: torch.Tensor | None  # fp32, [groups, 1]; None when symmetric
    bits: int
    groups: int

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        flat = self.codes.reshape(self.groups, -1).float() * self.scale
        if self.offset is not None:
            flat = flat + self.offset
        return flat.reshape(self.codes.shape).to(dtype)

    def per_element(self, stat: torch.Tensor | None) -> torch.Tensor | None:
        """A per-group statistic (scale or offset) expanded to one value per element of the tensor."""
        if stat is None:
            return None
        return stat.expand(self.groups, self.codes.numel() // self.groups).reshape(self.codes.shape)


def _rounded(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    if stochastic:  # unbiased rounding: floor(x + u), u ~ U[0, 1)
        return torch.floor(x + torch.rand_like(x))
    return torch.round(x)


def quantize_codes(
    x: torch.Tensor,
    bits: int,
    groups: int = 1,
    symmetric: bool = True,
    stochastic: bool = False,
    reduce: Reduce = _local,
) -> Codes:
    """Quantize ``x`` (any shape; ``groups`` must divide its size) to integer codes and group scales."""
    if x.numel() % groups:
        raise ValueError(f"quantize_groups {groups} does not divide the tensor's {x.numel()} elements")
    flat = x.detach().reshape(groups, -1).float()
    if bits == 1:
        return _binary(flat, x.shape, groups, reduce)
    if bits == 2:
        return _ternary(flat, x.shape, groups, reduce)
    levels = 2**bits
    if symmetric:
        absmax = reduce(flat.abs().amax(dim=1, keepdim=True), "max")
        scale = _nonzero(2 * absmax / levels)
        codes = _rounded(flat / scale, stochastic).clamp(-levels // 2, levels // 2 - 1)
        return Codes(codes.to(torch.int16).reshape(x.shape), scale, None, bits, groups)
    low = reduce(flat.amin(dim=1, keepdim=True), "min")
    high = reduce(flat.amax(dim=1, keepdim=True), "max")
    scale = _nonzero((high - low) / levels)
    offset = torch.round(low / scale) * scale
    codes = _rounded((flat - offset) / scale, stochastic).clamp(0, levels - 1)
    return Codes(codes.to(torch.int16).reshape(x.shape), scale, offset, bits, groups)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """An all-zero group has scale 0: use 1, its codes are all 0 (DeepSpeed divides by zero here)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _group_count(flat: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    count = torch.full((flat.shape[0], 1), float(flat.shape[1]), device=flat.device)
    return reduce(count, "sum")


def _ternary(flat: torch.Tensor, shape, groups: int, reduce: Reduce) -> Codes:
    magnitude = flat.abs()
    mean = reduce(magnitude.sum(dim=1, keepdim=True), "sum") / _group_count(flat, reduce)
    kept = magnitude > 0.7 * mean
    kept_sum = reduce((magnitude * kept).sum(dim=1, keepdim=True), "sum")
    kept_count = reduce(kept.sum(dim=1, keepdim=True).float(), "sum")
    scale = torch.where(kept_count > 0, kept_sum / kept_count.clamp(min=1), torch.zeros_like(kept_sum))
    codes = torch.sign(flat) * kept
    return Codes(codes.to(torch.int16).reshape(shape), scale, None, 2, groups)


def _binary(flat: torch.Tensor, shape, groups: int, reduce: Reduce) -> Codes:
    scale = reduce(flat.abs().sum(dim=1, keepdim=True), "sum") / _group_count(flat, reduce)
    return Codes(torch.sign(flat).to(torch.int16).reshape(shape), scale, None, 1, groups)


def straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in forward (exactly: ``x - x`` adds an exact zero), identity gradient to ``x`` in backward
    (the quantizers' estimator)."""
    return value.detach() + (x - x.detach())


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    groups: int = 1,
    symmetric: bool = True,
    stochastic: bool = False,
    reduce: Reduce = _local,
) -> torch.Tensor:
    """``x`` replaced by its quantized values (same dtype), with a straight-through gradient."""
    codes = quantize_codes(x, bits, groups, symmetric, stochastic, reduce)
    return straight_through(x, codes.values(x.dtype))


def quantize_activation(
    x: torch.Tensor,
    bits: int,
    symmetric: bool,
    groups: int = 1,
    value_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    reduce: Reduce = _local,
) -> torch.Tensor:
    """Quantize a layer input: per group of its elements (dynamic), or over a given (min, max) range (static)."""
    if value_range is None:
        return fake_quantize(x, bits, groups, symmetric, reduce=reduce)
    low, high = (t.float() for t in value_range)
    levels = 2**bits
    flat = x.detach().float()
    if symmetric:
        scale = _nonzero(2 * torch.maximum(low.abs(), high) / levels)
        values = (flat / scale).round().clamp(-levels // 2, levels // 2 - 1) * scale
    else:
        scale = _nonzero((high - low) / levels)
        offset = torch.round(low / scale) * scale
        values = ((flat - offset) / scale).round().clamp(0, levels - 1) * scale + offset
    return straight_through(x, values.to(x.dtype))


def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """1 for the ``ceil(dense_ratio * n)`` largest scores, 0 elsewhere; the gradient flows to ``scores``
    unchanged (DeepSpeed's ``TopKBinarizer``)."""
    keep = math.ceil(dense_ratio * scores.numel())
    mask = torch.zeros(scores.numel(), dtype=scores.dtype, device=scores.device)
    mask[scores.detach().flatten().topk(keep).indices] = 1
    return straight_through(scores, mask.view_as(scores))
