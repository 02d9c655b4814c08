"""DeepSpeed's autograd quantizers (``deepspeed.compression.utils``): straight-through estimators over the
arithmetic of quantizers.py. Same call signatures as 0.18.9: ``XQuantizer.apply(input, num_bits,
min_value=None, max_value=None, num_groups=1)`` and ``TopKBinarizer.apply(scores, threshold, sigmoid)``."""

from __future__ import annotations

import math

import torch

from shardspeed.compression.quantizers import quantize_activation, quantize_codes

__all__ = ["AsymQuantizer", "BinaryQuantizer", "SymQuantizer", "TernaryQuantizer", "TopKBinarizer"]


class TopKBinarizer(torch.autograd.Function):
    """1 for the ``ceil(threshold * n)`` largest inputs, else 0; gradient passed through to the inputs.
    ``sigmoid=True`` reads ``threshold`` as a logit tensor (and passes it a gradient), as DeepSpeed."""

    @staticmethod
    def forward(ctx, inputs, threshold, sigmoid):
        ratio = torch.sigmoid(threshold).item() if sigmoid else float(threshold)
        keep = math.ceil(ratio * inputs.numel())
        mask = torch.zeros(inputs.numel(), dtype=inputs.dtype, device=inputs.device)
        mask[inputs.flatten().topk(keep).indices] = 1
        mask = mask.view_as(inputs)
        ctx.sigmoid = sigmoid
        ctx.save_for_backward(mask)
        return mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        threshold_grad = (grad * mask).sum().view(-1) if ctx.sigmoid else None
        return grad.clone(), threshold_grad, None


class _Quantizer(torch.autograd.Function):
    BITS: int | None = None  # fixed width (ternary, binary); None = num_bits
    SYMMETRIC = True

    @classmethod
    def forward(cls, ctx, input, num_bits, min_value=None, max_value=None, num_groups=1):
        if (min_value is None) != (max_value is None):
            raise ValueError("give both min_value and max_value (a static range) or neither")
        if min_value is not None:
            if cls.BITS is not None:
                raise ValueError(f"{cls.__name__} takes no static range")
            return quantize_activation(input, num_bits, cls.SYMMETRIC, value_range=(min_value, max_value))
        bits = cls.BITS or num_bits
        return quantize_codes(input, bits, num_groups, cls.SYMMETRIC).values(input.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(), None, None, None, None


class SymQuantizer(_Quantizer):
    """Symmetric integer quantization per group (or over a static [min, max] range)."""


class AsymQuantizer(_Quantizer):
    """Asymmetric (scale and offset) integer quantization per group (or over a static range)."""

    SYMMETRIC = False


class TernaryQuantizer(_Quantizer):
    """XTC's ternary weights: {-a, 0, a} per group."""

    BITS = 2


class BinaryQuantizer(_Quantizer):
    """Binary weights: {-m, m} per group, m = mean |x|."""

    BITS = 1
