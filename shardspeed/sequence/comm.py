"""The all-to-all that swaps a sharded dimension for another, as an autograd function (Ulysses' only collective).

`all_to_all_swap(x, scatter_dim, gather_dim, group)`: split `x` into P equal chunks along `scatter_dim`, send
chunk i to rank i of `group`, and concatenate what arrives along `gather_dim`. Before attention DeepSpeed-Ulysses
scatters heads and gathers the sequence (each rank then holds every position of H/P heads); after attention it
does the reverse. The backward of a swap is the opposite swap, so both directions are one function.

Each rank sends and receives (P-1)/P of its tensor. Gloo implements `all_to_all_single` on CPU (torch >= 1.8),
NCCL on GPU, so no emulation is needed; the chunks are packed into one contiguous buffer first (one copy in,
one copy out), because the collective exchanges equal contiguous slices of dimension 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm import collectives

__all__ = ["SeqAllToAll", "all_to_all_swap", "check_divisible"]


def check_divisible(size: int, what: str, degree: int) -> None:
    """Refuse a dimension that the sequence-parallel degree does not divide, naming both numbers."""
    if size % degree != 0:
        raise ValueError(
            f"sequence parallelism: {what} ({size}) is not divisible by the sequence-parallel size ({degree})"
        )


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # [world, ...chunk]
    received = torch.empty_like(send)
    collectives.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class SeqAllToAll(torch.autograd.Function):
    """Forward: all-to-all scattering `scatter_dim`, gathering `gather_dim`. Backward: the reverse swap."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, _exchange(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None


def all_to_all_swap(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Differentiable all-to-all over `group`; `x.shape[scatter_dim]` must be divisible by the group size."""
    world = dist.get_world_size(group)
    check_divisible(
        x.shape[scatter_dim], f"dimension {scatter_dim} of a tensor of shape {tuple(x.shape)}", world
    )
    return SeqAllToAll.apply(group, x, scatter_dim, gather_dim)
