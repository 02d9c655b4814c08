"""Rotary position embedding (RoPE) in its "rotate half" form, as DeepSpeed's `sequence.layer` applies it.

For a head vector x split into halves (x1, x2), the rotation by the angles of position p is
x * cos(p) + rotate_half(x) * sin(p) with rotate_half(x) = (-x2, x1); `cos`/`sin` hold each frequency twice
(once per half). Only the first `rot_dim` features (the cos tensor's last dimension) rotate; the rest pass
through. DeepSpeed can hand this to a fused kernel (torchembed); shardspeed compiles no kernels, so it is
always these few PyTorch operations (autograd differentiates them).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FUSED_ROPE_KERNEL", "apply_rotary_pos_emb", "rotate_half"]

FUSED_ROPE_KERNEL = False  # DeepSpeed's `_torchembed_available`: no fused RoPE kernel is ever used here


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension, split in two halves."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotate the first `freqs_cos.shape[-1]` features of `t` ([seq, ..., dim]) by the broadcastable
    cos/sin tables ([seq, ..., rot_dim]); the other features are returned unchanged."""
    rot_dim = freqs_cos.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * freqs_cos + rotate_half(rotated) * freqs_sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)
