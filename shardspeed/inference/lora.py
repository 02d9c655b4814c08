"""LoRA fused around generation: the hybrid engine's ``fuse_lora_weight`` / ``unfuse_lora_weight``.

An RLHF actor is often trained with LoRA: DeepSpeed-Chat replaces each chosen ``nn.Linear`` by a module
that keeps the frozen base ``weight`` (and ``bias``) and adds a low-rank term,
``y = x W^T + b + scaling * (x @ lora_right_weight @ lora_left_weight)``, with ``lora_right_weight``
[in, r] and ``lora_left_weight`` [r, out]. DeepSpeed's hybrid engine recognises such a module by those
three attributes (``lora_right_weight``, ``lora_left_weight``, ``lora_scaling``) and, for generation,
folds the low-rank term into the base weight, ``W' = W + scaling * lora_left_weight^T @ lora_right_weight^T``,
so every token costs one matmul per linear instead of three.

DeepSpeed adds that product into ``W`` in place and subtracts it again after ``generate``. Here the fused
weight is a new tensor and ``W`` is never written: ``fused_lora(module)`` points each LoRA module's forward
at ``F.linear(x, W', b)`` for the block and restores the module's own forward on exit, so the base weights
afterwards are the same bits as before at any precision (in 16-bit, ``W + d - d`` is not ``W``), and a
weight the optimizer or ZeRO holds by identity is never touched. The cost is one copy of each wrapped
weight for the duration of the call. ``lora_dropout`` is not applied (generation runs in eval mode, where
it is the identity).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["fused_lora", "fused_weight", "is_lora_linear", "lora_linears"]

_LORA_ATTRS = ("lora_right_weight", "lora_left_weight", "lora_scaling", "weight")


def is_lora_linear(module: nn.Module) -> bool:
    """A linear with a LoRA term in DeepSpeed-Chat's layout (the attributes DeepSpeed's hybrid engine reads)."""
    return all(getattr(module, name, None) is not None for name in _LORA_ATTRS)


def lora_linears(module: nn.Module) -> list[nn.Module]:
    """Every LoRA linear under ``module``, in module order."""
    return [m for m in module.modules() if is_lora_linear(m)]


@torch.no_grad()
def fused_weight(module: nn.Module) -> torch.Tensor:
    """``W + scaling * lora_left_weight^T @ lora_right_weight^T``, a new tensor in the base weight's dtype."""
    weight = module.weight
    delta = torch.matmul(module.lora_left_weight.t(), module.lora_right_weight.t())
    if delta.shape != weight.shape:
        raise ValueError(
            f"LoRA: {type(module).__name__}'s lora_left_weight^T @ lora_right_weight^T is {tuple(delta.shape)}, "
            f"its weight {tuple(weight.shape)} (lora_right_weight must be [in, r], lora_left_weight [r, out])"
        )
    return weight.detach() + (module.lora_scaling * delta).to(weight.dtype)


def _plain_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x):
        return F.linear(x, weight, bias)

    return forward


@contextlib.contextmanager
def fused_lora(module: nn.Module):
    """Inside the block every LoRA linear under ``module`` runs as one linear over its fused weight; yields
    the fused weights (the copies the block holds). The weights must be whole while entering (gathered under
    ZeRO-3)."""
    layers = lora_linears(module)
    replaced, fused = [], []
    try:
        for layer in layers:
            bias = layer.bias.detach() if getattr(layer, "bias", None) is not None else None
            replaced.append((layer, layer.__dict__.get("forward")))
            # an instance attribute, which nn.Module's __call__ runs instead of the class's forward
            fused.append(fused_weight(layer))
            layer.forward = _plain_linear(fused[-1], bias)
        yield fused
    finally:
        for layer, own in replaced:
            if own is None:
                del layer.forward
            else:
                layer.forward = own
