"""Gradients as the caller left them: `OSS` used without `ShardedDataParallel`.

FairScale's OSS does no gradient communication of its own: the caller has already averaged the gradients
(torch's DistributedDataParallel, or gradients equal on every rank), and OSS only steps its part of the
parameters. `GivenGradients` is that gradient source for the ZeRO optimizer wrapper: at the step it copies
this rank's shard of each flat bucket out of the parameters' `.grad` (a parameter without one counts as
zeros, as a torch optimizer skips it). It has the reducer interface ZeroOptimizer drives (`finish`,
`flat_grads`, `zero`), with no hooks and no collective.
"""

from __future__ import annotations

import torch

from shardspeed.core.flat_params import FlatParamBucket

__all__ = ["GivenGradients"]


class GivenGradients:
    """This rank's gradient shards, read from `.grad` of the buckets' parameters when the step needs them."""

    def __init__(self, buckets: list[FlatParamBucket]):
        self.buckets = buckets
        self.sync_enabled = True  # the ZeroOptimizer protocol sets these; nothing is reduced here
        self.final = True
        self._shards: list[torch.Tensor] | None = None

    def finish(self) -> None:
        """Read the shards now (idempotent until `zero`): the step and `clip_grad_norm` use the same copy."""
        if self._shards is not None:
            return
        shards = []
        for bucket in self.buckets:
            shard = torch.zeros(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
            for index, _, param_start, shard_start, length in bucket.fragments():
                grad = bucket.params[index].grad
                if grad is not None:
                    piece = grad.detach().reshape(-1)[param_start : param_start + length]
                    shard[shard_start : shard_start + length].copy_(piece)
            shards.append(shard)
        self._shards = shards

    def flat_grads(self) -> list[torch.Tensor]:
        self.finish()
        return self._shards

    def zero(self) -> None:
        """Forget the shards read for this step (the parameters' `.grad` belong to the caller)."""
        self._shards = None

    def remove_hooks(self) -> None:
        pass
