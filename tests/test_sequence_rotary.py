"""Rotary position embedding (shardspeed/sequence/rotary.py, DeepSpeed's `sequence.layer.apply_rotary_pos_emb`):
each pair of features (i, i + rot_dim/2) turns by its position's angle, the features past rot_dim pass through."""

from __future__ import annotations

import math

import torch

from shardspeed.sequence.rotary import apply_rotary_pos_emb, rotate_half


def test_rotation_turns_each_feature_pair_by_its_angle_and_keeps_the_rest():
    seq, heads, dim, rot_dim = 5, 2, 10, 6
    t = torch.randn(seq, heads, dim, dtype=torch.float64)
    angles = torch.rand(seq, rot_dim // 2, dtype=torch.float64) * math.pi
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).unsqueeze(1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).unsqueeze(1)
    out = apply_rotary_pos_emb(t, cos, sin)
    half = rot_dim // 2
    x, y = t[..., :half], t[..., half:rot_dim]
    c, s = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    torch.testing.assert_close(out[..., :half], x * c - y * s)  # a 2-D rotation of (x, y)
    torch.testing.assert_close(out[..., half:rot_dim], y * c + x * s)
    torch.testing.assert_close(out[..., rot_dim:], t[..., rot_dim:])
    torch.testing.assert_close(out.norm(dim=-1), t.norm(dim=-1))  # rotations keep lengths
    torch.testing.assert_close(
        rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([-3.0, -4.0, 1.0, 2.0])
    )


def test_gradients_flow_through_the_rotation():
    t = torch.randn(4, 3, 8, requires_grad=True)
    angles = torch.rand(4, 1, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    apply_rotary_pos_emb(t, cos, sin).pow(2).sum().backward()
    torch.testing.assert_close(t.grad, 2 * t.detach())  # |R x|^2 = |x|^2, so the gradient is 2x
