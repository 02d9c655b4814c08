"""The all-to-all exchange MoE dispatch and combine use, as an autograd function.

`AllToAll.apply(group, x)` splits `x` along dim 0 into one equal chunk per rank of `group`, sends chunk j to
rank j and concatenates what it receives in rank order. Its backward is the same exchange (the inverse
permutation of chunks), so gradients flow back to the rank that sent each token.

torch's Gloo backend implements `all_to_all_single` natively on CPU (checked on torch 2.13), so it is used
on every backend: NCCL's all-to-all on GPUs, Gloo's on CPUs. A rank sends and receives
`(world - 1) / world` of the tensor, once forward and once backward per exchange. The bytes each exchange
moves are counted in `traffic` (what `benchmarks/moe.py` reports).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm import logger

__all__ = ["AllToAll", "all_to_all", "traffic"]


class _Traffic:
    """Bytes this rank sent to other ranks through MoE all-to-alls (forward and backward), and how often."""

    def __init__(self):
        self.bytes_sent = 0
        self.calls = 0

    def reset(self) -> None:
        self.bytes_sent = self.calls = 0


traffic = _Traffic()


def all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """One all-to-all over `group` of `tensor`'s dim-0 chunks (a copy when the group has one rank)."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return tensor
    if tensor.shape[0] % world != 0:
        raise ValueError(f"all-to-all: dim 0 ({tensor.shape[0]}) is not divisible by the group size {world}")
    tensor = tensor.contiguous()
    output = torch.empty_like(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    traffic.bytes_sent += nbytes * (world - 1) // world
    traffic.calls += 1
    log = logger.active()
    if log is None:
        dist.all_to_all_single(output, tensor, group=group)
    else:
        log.timed("all_to_all_single", nbytes, lambda: dist.all_to_all_single(output, tensor, group=group),
                  group=group)  # fmt: skip
    return output


class AllToAll(torch.autograd.Function):
    """Forward: exchange dim-0 chunks over `group`. Backward: the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, group, tensor: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return all_to_all(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, all_to_all(grad, ctx.group)
