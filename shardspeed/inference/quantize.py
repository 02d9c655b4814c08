"""Weight-only int8 quantization (``dtype: int8``): linear weights stored as int8 with one scale per row.

Each ``nn.Linear`` becomes an ``Int8Linear``: weights take a quarter of fp32's memory, and the forward
dequantizes the weight to the activations' dtype before the matmul (no int8 kernels are needed, so it runs
on any device; it saves memory, not time). Symmetric per-output-channel scales: ``w ≈ q * scale``, ``q`` in
[-127, 127].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Linear", "quantize_linears_int8"]


class Int8Linear(nn.Module):
    """A linear layer whose weight is kept in int8 with a per-output-row scale."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        self.register_buffer("qweight", torch.round(weight / scale).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a temporary; it is what the matmul sees)."""
        return self.qweight.to(self.scale.dtype) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def quantize_linears_int8(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` by an ``Int8Linear``; returns how many were replaced."""
    if any(type(m).__name__ in ("LinearLayer", "LinearAllreduce") for m in model.modules()):
        raise ValueError(
            "dtype: int8 (weight-only quantization) is not supported together with tensor parallelism; "
            "use fp16/bf16/fp32 with tensor_parallel.tp_size > 1, or int8 with tp_size 1"
        )
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, Int8Linear(linear))
    return len(targets)
