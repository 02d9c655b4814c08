"""Flat-tensor collectives under the names of the running torch version.

torch 2.13 renamed `reduce_scatter_tensor`/`all_gather_into_tensor` to `reduce_scatter_single`/
`all_gather_single` (the old names warn); torch 2.4 has only the old ones. ZeRO calls these two helpers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum `input` (world_size equal slices) across ranks; this rank's slice of the sum lands in `output`.

    `output` may be this rank's slice of `input` itself (in place, as NCCL and Gloo allow).
    """
    return _reduce_scatter(output, input, group=group, async_op=async_op)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `input` into `output`; `input` may be this rank's slice of `output`."""
    return _all_gather(output, input, group=group, async_op=async_op)
