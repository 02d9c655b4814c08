"""Autograd functions that move activations into and out of a tensor-parallel region.

Megatron's pair, named for what they do forward and backward:

- `copy_to_tensor_parallel(x, group)`: identity forward, all-reduce (sum) of the gradient backward. Placed in
  front of a column-parallel layer: every tensor rank reads the same input, each contributes the part of
  the input's gradient that its output columns produce, and the sum is the full gradient.
- `reduce_from_tensor_parallel(x, group)`: all-reduce (sum) forward, identity backward. Placed after a
  row-parallel layer: each rank holds a partial product over its slice of the input features.

- `gather_from_tensor_parallel(x, group)`: all-gather along the last dimension forward, this rank's slice
  of the gradient backward. After a column-parallel layer whose output every rank needs whole (an untied
  LM head with `gather_output`); the slice is exact because every rank holds the same whole gradient.

One tensor-parallel block (column layer, then row layer) therefore costs one all-reduce forward and one
backward. A group of size 1 (or None) makes both functions the identity with no collective.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

__all__ = [
    "SharedInputCopy",
    "copy_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "group_size",
    "reduce_from_tensor_parallel",
    "sum_gradient_over_group",
]


def group_size(group) -> int:
    """Number of ranks in `group`; 1 for None (no tensor parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone() if not x.is_contiguous() else x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.width = x.shape[-1]
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad.narrow(-1, rank * ctx.width, ctx.width).contiguous(), None


def copy_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; gradient all-reduced over `group` backward."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over `group` forward; gradient passed through unchanged backward."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension; gradient sliced back backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromTensorParallel.apply(x, group)


def sum_gradient_over_group(param: torch.Tensor, group) -> None:
    """Make `param`'s gradient the sum over `group` of each rank's contribution (a hook run before the
    gradient is accumulated): for a parameter kept whole whose input is this rank's shard of the activations.
    `param._ds_grad_allreduce_registered` says it is done (DeepSpeed's marker)."""
    if group_size(group) == 1 or getattr(param, "_ds_grad_allreduce_registered", False):
        return

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(summed)
    param._ds_grad_allreduce_registered = True


class SharedInputCopy:
    """One copy-to region for the column layers that read the same input tensor (q, k and v; gate and up).

    Autograd then sums their partial input gradients locally and the sum is all-reduced once: one
    all-reduce per block input in backward instead of one per column layer (3 -> 1 for separate q/k/v).
    It remembers only the latest input (a weak reference) and its copy, so it holds at most one activation
    between steps. The copy node saves no tensors, so reusing it is safe even if the same tensor object is
    fed twice.
    """

    def __init__(self):
        self._source = None
        self._copied = None

    def __call__(self, x: torch.Tensor, group) -> torch.Tensor:
        if group_size(group) == 1:
            return x
        if self._source is not None and self._source() is x and self._copied is not None:
            return self._copied
        copied = _CopyToTensorParallel.apply(x, group)
        self._source, self._copied = weakref.ref(x), copied
        return copied

    def __getstate__(self):  # deepcopy/pickle of a sharded model: start with an empty slot
        return {}

    def __setstate__(self, state):
        self.__init__()
