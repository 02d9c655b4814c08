"""Fused projections for the fast decode path: q/k/v as one matmul, gate/up as one matmul.

At small and medium sizes a decode step is many small matmuls, each with a fixed cost; three (q, k, v)
or two (gate, up) linears reading the same input become one. ``fuse_linears`` concatenates their weights
into one tensor and points each module's weight at its slice of it (a view: no second copy of the
weights, and the modules, their state dict and a tensor-parallel split keep working as before). Only plain
linears qualify (``nn.Linear``, module_inject's column-parallel ``LinearLayer`` in [out, in] orientation);
anything else (int8, GPT-2's transposed Conv1D) keeps its separate calls.

``fused_copy`` is the form for a model that is being trained (the hybrid engine's rollouts): the optimizer
and ZeRO hold its parameters by identity, so they are left alone and the fused weight is a new tensor,
made from the weights as they are at the call and dropped with the decoder when the call returns.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FusedLinear", "fuse_linears", "fused_copy"]

_FUSABLE = {"Linear", "LinearLayer"}


class FusedLinear:
    """One weight/bias for several linears; ``__call__`` returns their outputs, split."""

    def __init__(
        self, modules, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], copy: bool = False
    ):
        self.modules, self.weight, self.bias, self.sizes = modules, weight, bias, sizes
        self.copy = copy  # a copy (fused_copy) shares no storage with the modules: nothing to re-check

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.joint(x).split(self.sizes, dim=-1)

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs side by side on the last dimension, unsplit."""
        if not self.copy and self.modules[0].weight.data_ptr() != self.weight.data_ptr():
            # The model's weights were replaced after fusing (``.to(dtype)``, a new state dict): fuse again.
            fresh = fuse_linears(self.modules)
            if fresh is None:
                return torch.cat([module(x) for module in self.modules], dim=-1)
            self.weight, self.bias = fresh.weight, fresh.bias
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _fusable(modules) -> bool:
    if not all(type(m).__name__ in _FUSABLE and not getattr(m, "transposed", False) for m in modules):
        return False
    weights = [m.weight for m in modules]
    first = weights[0]
    same = all(w.dim() == 2 and w.shape[1] == first.shape[1] and w.dtype == first.dtype for w in weights)
    biases = [m.bias is not None for m in modules]
    return same and (all(biases) or not any(biases)) and first.device.type != "meta"


def _as_view(module: nn.Module, name: str, view: torch.Tensor) -> None:
    old = getattr(module, name)
    new = nn.Parameter(view, requires_grad=False)
    for key, extra in vars(old).items():  # keep tp_partition and friends
        setattr(new, key, extra)
    setattr(module, name, new)


@torch.no_grad()
def fuse_linears(modules) -> FusedLinear | None:
    """A ``FusedLinear`` over ``modules`` (whose weights become views into it), or None if they do not fuse."""
    fuse_own = getattr(
        type(modules[0]), "fuse", None
    )  # layers with their own fused form (packed, compressed)
    if fuse_own is not None and all(type(m) is type(modules[0]) for m in modules):
        return fuse_own(modules)
    if not _fusable(modules):
        return None
    sizes = [m.weight.shape[0] for m in modules]
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
    offset = 0
    for module, size in zip(modules, sizes):
        _as_view(module, "weight", weight[offset : offset + size])
        if bias is not None:
            _as_view(module, "bias", bias[offset : offset + size])
        offset += size
    return FusedLinear(list(modules), weight, bias, sizes)


@torch.no_grad()
def fused_copy(modules) -> FusedLinear | None:
    """A ``FusedLinear`` over a copy of ``modules``' weights, the modules untouched; None if they do not fuse
    (or have a fused form of their own, which rebinds their weights)."""
    if getattr(type(modules[0]), "fuse", None) is not None or not _fusable(modules):
        return None
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
    return FusedLinear(list(modules), weight, bias, [m.weight.shape[0] for m in modules], copy=True)
