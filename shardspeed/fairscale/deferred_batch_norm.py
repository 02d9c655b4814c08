"""`Pipe(deferred_batch_norm=True)`: batch norms whose running statistics are those of the whole batch.

Split into micro-batches, a batch norm would update its running mean and variance once per micro-batch, from
micro-batch statistics: not what the same model trained on the whole batch keeps. With deferred batch norm
each micro-batch is still normalized with its own statistics (the forward pass is unchanged), but the running
statistics only accumulate the per-channel sums; once every micro-batch of the batch has run, Pipe commits
them, one update from the whole batch's mean and unbiased variance, as the unsplit batch norm would make.
Recomputation under activation checkpointing runs the forward again; it must not accumulate twice, so Pipe
runs it with tracking off (`untracked`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "untracked"]


class DeferredBatchNorm(_BatchNorm):
    """A batch norm (any dimension) that accumulates statistics over micro-batches until `commit()`."""

    def __init__(self, source: _BatchNorm):
        super().__init__(source.num_features, source.eps, source.momentum, source.affine, True)
        # the same parameters and buffers: optimizers, state dicts and callers keep seeing the original ones
        self.weight, self.bias = source.weight, source.bias
        self.running_mean, self.running_var = source.running_mean, source.running_var
        self.num_batches_tracked = source.num_batches_tracked
        self.training = source.training
        self.tracking = True
        self._reset_sums()

    def _reset_sums(self) -> None:
        self._sum: torch.Tensor | None = None
        self._sum_of_squares: torch.Tensor | None = None
        self._count = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm: expected at least 2D input (batch, channels, ...), got {input.dim()}D"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        if self.tracking:
            with torch.no_grad():
                dims = [0, *range(2, input.dim())]
                values = input.detach().double()
                sums, squares = values.sum(dims), values.pow(2).sum(dims)
                self._sum = sums if self._sum is None else self._sum + sums
                self._sum_of_squares = (
                    squares if self._sum_of_squares is None else self._sum_of_squares + squares
                )
                self._count += input.numel() // input.shape[1]
        # normalized with the micro-batch's own statistics, running statistics left alone (None)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """One running-statistics update from everything accumulated since the last commit."""
        if self._count == 0:
            return
        count = self._count
        mean = self._sum / count
        variance = (self._sum_of_squares / count - mean.pow(2)) * (count / max(count - 1, 1))  # unbiased
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(variance.to(self.running_var.dtype), alpha=factor)
        self._reset_sums()


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """`module` with every batch norm that keeps running statistics replaced by a DeferredBatchNorm."""
    if (
        isinstance(module, _BatchNorm)
        and module.track_running_stats
        and not isinstance(module, DeferredBatchNorm)
    ):
        return DeferredBatchNorm(module)
    for name, child in module.named_children():
        converted = convert_deferred_batch_norm(child)
        if converted is not child:
            setattr(module, name, converted)
    return module


@contextlib.contextmanager
def untracked(module: nn.Module):
    """Runs `module`'s deferred batch norms without accumulating (a recomputation of a forward pass)."""
    norms = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
    before = [m.tracking for m in norms]
    for m in norms:
        m.tracking = False
    try:
        yield
    finally:
        for m, tracking in zip(norms, before):
            m.tracking = tracking
