"""`checkpoint` and `non_reentrant_checkpoint`: run a block without keeping its activations, recompute them
in backward.

`checkpoint` is DeepSpeed's reentrant form, an autograd Function: the forward runs under `no_grad` and keeps
only the block's inputs (where `storage.store` puts them); backward restores the inputs and the RNG
states the forward started from (CPU, accelerator, and every model-parallel tracker stream), runs the block
again with grad and backpropagates through that copy. A zero-size tensor that requires grad is passed
along so the Function is part of the graph even when no input requires grad — otherwise the block's
parameters would silently get no gradient (the classic reentrant-checkpoint trap).

`non_reentrant_checkpoint` is `torch.utils.checkpoint` with `use_reentrant=False` (saved-tensor hooks, early
stop of the recomputation), plus the tracker streams restored for the recomputation.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.utils.checkpoint as torch_checkpoint

from shardspeed import accelerator
from shardspeed.checkpointing import state
from shardspeed.checkpointing.rng import get_cuda_rng_tracker, get_device_rng_state, set_device_rng_state
from shardspeed.checkpointing.storage import ContiguousSlots, store
from shardspeed.utils.logging import log_dist

__all__ = ["checkpoint", "non_reentrant_checkpoint", "reset"]

_slots: ContiguousSlots | None = None


class _RngSnapshot:
    """The generator states a block's forward started from, restored around its recomputation."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.device = get_device_rng_state() if accelerator.has_cuda() else None
        self.tracker = get_cuda_rng_tracker().get_states()

    @contextlib.contextmanager
    def restored(self):
        outside = _RngSnapshot()
        self._apply()
        try:
            yield
        finally:
            outside._apply()

    def _apply(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            set_device_rng_state(self.device)
        get_cuda_rng_tracker().set_states(self.tracker)


def _boundary(settings: state.Settings, device: torch.device) -> None:
    if settings.synchronize_checkpoint_boundary or settings.profile:
        accelerator.synchronize(device)


def _contiguous_slots(settings: state.Settings) -> ContiguousSlots | None:
    global _slots
    if not settings.contiguous_memory_optimization:
        return None
    if _slots is None or _slots.limit != settings.number_checkpoints:
        _slots = ContiguousSlots(settings.number_checkpoints)
    return _slots


def _record(settings: state.Settings, phase: str, seconds: float) -> None:
    settings.timings[phase] = settings.timings.get(phase, 0.0) + seconds


class CheckpointFunction(torch.autograd.Function):
    """Forward: run without grad, keep the inputs. Backward: recompute with grad and backpropagate."""

    @staticmethod
    def forward(ctx, run_function, settings, result_kind, anchor, *args):
        device = next((a.device for a in args if torch.is_tensor(a)), torch.device("cpu"))
        _boundary(settings, device)
        started = time.perf_counter()
        ctx.run_function, ctx.settings, ctx.device = run_function, settings, device
        ctx.rng = _RngSnapshot()
        group, slots = state.model_parallel_group(settings), _contiguous_slots(settings)
        ctx.stored = []
        for a in args:
            if torch.is_tensor(a):
                kept = store(a.detach(), cpu=settings.cpu_checkpointing, group=group, slots=slots)
                ctx.stored.append((kept, a.requires_grad))
            else:
                ctx.stored.append((a, None))
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.single = not isinstance(outputs, tuple)
        result_kind["single"] = ctx.single  # apply() always returns a tuple; checkpoint() unwraps it
        outputs = (outputs,) if ctx.single else outputs
        ctx.mark_non_differentiable(*[o for o in outputs if torch.is_tensor(o) and not o.is_floating_point()])
        _boundary(settings, device)
        if settings.profile:
            _record(settings, "forward", time.perf_counter() - started)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        settings = ctx.settings
        _boundary(settings, ctx.device)
        started = time.perf_counter()
        inputs = []
        for kept, requires_grad in ctx.stored:
            if requires_grad is None:
                inputs.append(kept)
                continue
            tensor = kept.restore().detach()
            kept.release()
            inputs.append(tensor.requires_grad_(requires_grad))
        ctx.stored = None  # the saved inputs are not needed again
        with ctx.rng.restored(), torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        outputs = (outputs,) if ctx.single else outputs
        pairs = [
            (o, g)
            for o, g in zip(outputs, grad_outputs)
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(t.grad if torch.is_tensor(t) and t.requires_grad else None for t in inputs)
        _boundary(settings, ctx.device)
        if settings.profile:
            _record(settings, "recompute_and_backward", time.perf_counter() - started)
        return (None, None, None, None, *grads)


def checkpoint(function, *args, **kwargs):
    """Run `function(*args, **kwargs)` keeping only its inputs; recompute it in backward (DeepSpeed's
    reentrant form).

    Arguments (positional or keyword) and results may include non-tensors and None; a tensor passed by
    keyword gets its gradient like a positional one. Returns what `function` returns (a tuple is returned as
    a tuple).
    """
    if not torch.is_grad_enabled():  # nothing will backpropagate: no reason to save anything
        return function(*args, **kwargs)
    if kwargs:  # the Function takes positional inputs only: keyword values travel after the positional ones
        function, args = _keywords_as_positional(function, args, kwargs)
    settings = state.current()
    anchor = torch.empty(0, requires_grad=True)
    result_kind: dict[str, bool] = {}
    outputs = CheckpointFunction.apply(function, settings, result_kind, anchor, *args)
    if settings.profile and settings.timings:
        log_dist(
            "activation checkpointing: "
            + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in settings.timings.items())
        )
    return outputs[0] if result_kind["single"] else outputs


def _keywords_as_positional(function, args: tuple, kwargs: dict):
    names, count = tuple(kwargs), len(args)

    def call(*values):
        return function(*values[:count], **dict(zip(names, values[count:])))

    return call, (*args, *kwargs.values())


def _tracker_contexts():
    """torch.utils.checkpoint `context_fn`: restore the tracker streams the forward saw for the recompute."""
    forward_states = get_cuda_rng_tracker().get_states()

    @contextlib.contextmanager
    def recompute():
        tracker = get_cuda_rng_tracker()
        outside = tracker.get_states()
        tracker.set_states(forward_states)
        try:
            yield
        finally:
            tracker.set_states(outside)

    return contextlib.nullcontext(), recompute()


def non_reentrant_checkpoint(function, *args, **kwargs):
    """`torch.utils.checkpoint` (non-reentrant) with the model-parallel RNG streams restored on recompute."""
    return torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_tracker_contexts, **kwargs
    )


def reset() -> None:
    """Drop the contiguous buffers (DeepSpeed calls this between evaluation and training)."""
    global _slots
    if _slots is not None:
        _slots.reset()
    _slots = None
