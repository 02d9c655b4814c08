"""FairScale's `checkpoint_wrapper`: a module whose forward keeps no activations and is recomputed in backward.

    layer = checkpoint_wrapper(layer, offload_to_cpu=False)

It runs the module's forward through shardspeed's activation checkpointing
(`shardspeed.checkpointing.non_reentrant_checkpoint`: torch.utils.checkpoint without reentrancy, with the
model-parallel RNG streams restored for the recomputation), so keyword arguments, non-tensor outputs and
inputs that do not require grad all work. `offload_to_cpu` keeps the saved inputs in host memory
(torch.autograd.graph.save_on_cpu) until the recomputation needs them. `is_checkpointing()` and
`is_recomputing()` tell code inside the forward which pass it is in, as FairScale's do. Batch norms update
their running statistics in the forward only, not again in the recomputation. Without grad (eval,
`torch.no_grad`) the forward runs as is.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch import nn

from shardspeed.checkpointing import non_reentrant_checkpoint

__all__ = ["checkpoint_wrapper", "disable_checkpointing", "is_checkpointing", "is_recomputing"]

_phase = threading.local()  # .checkpointing / .recomputing while a wrapped forward runs


@contextlib.contextmanager
def disable_checkpointing():
    """Inside this context wrapped modules run their forward as is (keeping their activations)."""
    old = getattr(_phase, "disabled", False)
    _phase.disabled = True
    try:
        yield
    finally:
        _phase.disabled = old


def is_checkpointing() -> bool:
    """True inside the first (activation-free) forward of a checkpointed module."""
    return getattr(_phase, "checkpointing", False)


def is_recomputing() -> bool:
    """True inside the recomputation a checkpointed module runs in backward."""
    return getattr(_phase, "recomputing", False)


@contextlib.contextmanager
def _in_phase(name: str):
    old = getattr(_phase, name, False)
    setattr(_phase, name, True)
    try:
        yield
    finally:
        setattr(_phase, name, old)


@contextlib.contextmanager
def _running_stats_frozen(module: nn.Module):
    """During the recomputation, batch norms compute exactly as in the forward, and their running statistics
    are put back afterwards, so they count each batch once (FairScale's checkpoint_wrapper does the same)."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    buffers = [
        b for m in norms for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None
    ]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """`module` itself, its forward checkpointed (FairScale's signature; the original forward is kept as
    `module.precheckpoint_forward`)."""
    original = module.forward
    module.precheckpoint_forward = original

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled() or getattr(_phase, "disabled", False):
            return original(*args, **kwargs)
        calls = {"count": 0}

        def run(*inner_args, **inner_kwargs):
            calls["count"] += 1
            if calls["count"] == 1:
                with _in_phase("checkpointing"):
                    return original(*inner_args, **inner_kwargs)
            with _in_phase("recomputing"), _running_stats_frozen(module):
                return original(*inner_args, **inner_kwargs)

        storage = (
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            if offload_to_cpu
            else contextlib.nullcontext()
        )
        with storage:
            return non_reentrant_checkpoint(run, *args, **kwargs)

    module.forward = forward
    return module
