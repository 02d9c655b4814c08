"""The loss of a sequence-parallel step: the mean over every token of the sequence group, not of one slice.

The engine averages gradients over the data x sequence ranks. When every rank's slice holds the same number
of counted tokens, each rank's own mean loss is all that is needed: the average of the slice means is the
mean over the sequence. When tokens are masked (padding, `ignore_index`), slices count different numbers of
tokens and the average of means is wrong; `sequence_parallel_mean(loss_sum, num_tokens, group)` gives the
true mean instead (one all-reduce of two numbers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["sequence_parallel_mean"]


def sequence_parallel_mean(loss_sum: torch.Tensor, num_tokens, group) -> torch.Tensor:
    """Sum of this rank's token losses / tokens of the whole sequence group; differentiable.

    The value is the same on every rank of `group` (for logging). Its gradient on rank r is
    P * d(loss_sum_r) / N, so that the engine's average over the P sequence ranks yields
    d(sum over the group) / N: the gradient of the group's mean, as one process would compute it.
    """
    degree = dist.get_world_size(group)
    totals = torch.stack([loss_sum.detach().float(), torch.as_tensor(num_tokens, dtype=torch.float32,
                                                                     device=loss_sum.device)])  # fmt: skip
    dist.all_reduce(totals, group=group)
    global_mean = totals[0] / totals[1]
    local = loss_sum * degree / totals[1]
    return (global_mean + (local - local.detach())).to(loss_sum.dtype)
