"""FairScale's `AdaScale`: an optimizer wrapper that scales the learning rate by the gain ratio of a large batch.

AdaScale (Johnson et al., "AdaScale SGD", ICML 2020) trains with a batch `scale` times the baseline batch and
multiplies the learning rate, step by step, by the gain ratio

    gain = (var + sqr) / (var / scale + sqr)

where `sqr` estimates the squared norm of the true gradient (mu^2 in the paper) and `var` the trace of the
covariance of one baseline batch's gradient (sigma^2). While gradients are noisy (var >> sqr) the gain nears
`scale` (a larger batch is worth `scale` steps); when they agree (var << sqr) it nears 1. `gain()` is also how
far the step counts in "scale-invariant" iterations: training loops add it to their step counter.

Estimating var and sqr needs the gradient of each of the n = world_size * num_gradients_to_accumulate
micro-batches taken separately: their spread is the variance. So a hook on every parameter sees the gradient
of each backward pass as autograd produces it and adds its squared norm to this rank's sum. Those hooks are
tensor hooks (`param.register_hook`): autograd runs them on the gradient of this backward pass before it is
accumulated into `param.grad`, and before DistributedDataParallel's reducer, which hooks the accumulation
itself, averages `param.grad` across ranks. So the same hook gives each rank's local, per-micro-batch gradient
with or without DDP, and no change to DDP is needed. After the last micro-batch's backward the sums are added
across ranks (one all-reduce of one number per parameter group) and compared with the squared norm of the
averaged `param.grad`:

    local = sum_i |g_i|^2 over the n micro-batch gradients,   total = |mean_i g_i|^2
    var   = scale / (n - 1) * (local / n - total)      (the unbiased sample variance, rescaled to the baseline)
    sqr   = total - var / scale

both clamped (var >= 1e-6, sqr >= 0) and smoothed over steps with an exponentially weighted moving average
(`smoothing`; debiased by default, or the paper's Appendix B.3 running mean then EWMA with
`debias_ewma=False`). The estimates live in the wrapped optimizer's state (key "adascale") so they are saved
and loaded with its state_dict.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.optim import SGD, Optimizer

__all__ = ["AdaScale", "AdaScaleWrapper"]

_STATE_KEY = "adascale"
_MIN_VAR = 1e-6  # the variance floor: keeps the gain finite and defined when all micro-batches agree


class AdaScale(Optimizer):
    """Wraps `optimizer` and multiplies each group's learning rate by its AdaScale gain at every `step()`.

    world_size: ranks averaging gradients (default: the process group's size, 1 without one);
    scale: the batch relative to the baseline (default world_size * num_gradients_to_accumulate);
    smoothing: EWMA factor (default max(1 - world_size * num_gradients_to_accumulate / 1000, 0));
    num_gradients_to_accumulate: backward passes per step; is_scaled_loss: whether each pass's loss is already
    divided by that number (otherwise call `scale_grad_by_num_grads_to_accum()` before `step()`);
    debias_ewma: debiased EWMA (default) or the paper's running mean then EWMA.

    It subclasses `torch.optim.Optimizer` (without calling its constructor) so that LR schedulers accept it;
    they change `param_groups`, which are the wrapped optimizer's own.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        world_size: int | None = None,
        scale: float | None = None,
        smoothing: float | None = None,
        num_gradients_to_accumulate: int = 1,
        is_scaled_loss: bool = True,
        debias_ewma: bool = True,
    ):
        self._hook_handles: list[Any] = []
        self._optimizer = optimizer
        self._local_grad_sqr: torch.Tensor | None = None  # this rank's running sum, None outside backward
        self._callback_queued = False
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._world_size = world_size
        self._num_backward_calls = 0
        self._debias_ewma = debias_ewma
        self._is_scaled_loss = is_scaled_loss
        self.param_groups = optimizer.param_groups
        self.set_num_gradients_to_accumulate(num_gradients_to_accumulate, update_smoothing=True)
        if smoothing is not None:
            if not 0 <= smoothing < 1:
                raise ValueError(f"AdaScale: smoothing must be in [0, 1), got {smoothing}")
            self._smoothing = smoothing
        if self._world_size * self._num_grads_to_accum <= 1:
            # With one gradient per step there is no spread to estimate the variance from.
            raise RuntimeError(
                "AdaScale needs more than one gradient per step: world_size * num_gradients_to_accumulate "
                f"is {self._world_size * self._num_grads_to_accum}"
            )
        groups = len(optimizer.param_groups)
        optimizer.state.setdefault(
            _STATE_KEY,
            {
                "grad_sqr_avg": torch.ones(groups, dtype=torch.float64),
                "grad_var_avg": torch.zeros(groups, dtype=torch.float64),
            },
        )
        self.set_scale(self._world_size * self._num_grads_to_accum if scale is None else scale)
        self._hook()

    # -- what the wrapped optimizer holds ---------------------------------------------------------------------

    @property
    def state(self) -> Any:  # the wrapped optimizer's (LR schedulers and checkpoints look here)
        return self._optimizer.state

    @property
    def defaults(self) -> dict:
        return self._optimizer.defaults

    @property
    def _state(self) -> dict[str, torch.Tensor]:
        return self._optimizer.state[_STATE_KEY]

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks: the wrapped optimizer's own (FairScale forwards them too).
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    # -- hooks ------------------------------------------------------------------------------------------------

    def _hook(self) -> None:
        for index, group in enumerate(self._optimizer.param_groups):
            for param in group["params"]:
                self._hook_handles.append(param.register_hook(functools.partial(self._on_grad, index)))

    def unhook(self) -> None:
        """Removes the gradient hooks (they hold this object, and through it the parameters)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def __del__(self) -> None:
        self.unhook()

    def _on_grad(self, group: int, grad: torch.Tensor) -> None:
        if self._local_grad_sqr is None:
            # on the gradients' device: no host sync per parameter; one all-reduce and one copy at the end
            self._local_grad_sqr = torch.zeros(
                len(self._optimizer.param_groups), dtype=torch.float64, device=grad.device
            )
        self._local_grad_sqr[group] += grad.detach().double().pow(2).sum().to(self._local_grad_sqr.device)
        if not self._callback_queued:
            self._callback_queued = True
            # Queued from a callback, the end-of-pass work runs after every callback queued during the pass
            # (DDP's reducer finishes its averaging in one), so param.grad is final when it reads it.
            Variable._execution_engine.queue_callback(
                lambda: Variable._execution_engine.queue_callback(self._end_of_backward)
            )

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._num_backward_calls += 1
        if self._num_backward_calls < self._num_grads_to_accum:
            return  # more micro-batches to come before the step
        self._num_backward_calls = 0
        local = self._local_grad_sqr
        self._local_grad_sqr = None
        if self._world_size > 1:
            dist.all_reduce(local)  # the sum over ranks of each rank's sum over micro-batches
        local = local.cpu()
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        if all(p.grad is None for p in params):
            # gradients arrived but none is left in .grad: a wrapper keeps them elsewhere (ShardedDataParallel
            # keeps the averaged gradients as shards); |mean gradient|^2 would read 0 and the gain be wrong
            raise RuntimeError(
                "AdaScale needs the averaged gradients in param.grad after backward, and every param.grad is "
                "None: wrap the model in DistributedDataParallel, not ShardedDataParallel"
            )
        total = torch.tensor(
            [
                sum(float(p.grad.double().pow(2).sum()) for p in group["params"] if p.grad is not None)
                for group in self._optimizer.param_groups
            ],
            dtype=torch.float64,
        )
        accum = self._num_grads_to_accum
        if accum > 1:
            if self._is_scaled_loss:
                local = local * accum**2  # each pass's gradient was divided by accum
            else:
                total = total / accum**2  # param.grad is the sum of the passes, not yet their mean
        n = self._world_size * accum
        scale = self._scale
        var = scale / (n - 1) * (local / n - total)
        sqr = total - var / scale
        self._update_avg("grad_sqr_avg", sqr.clamp(min=0.0))
        self._update_avg("grad_var_avg", var.clamp(min=_MIN_VAR))

    def _update_avg(self, name: str, value: torch.Tensor) -> None:
        state, factor = self._state, self._smoothing
        if self._debias_ewma:
            zeros = torch.zeros_like(value)
            biased = factor * state.get(name + "_biased", zeros) + (1.0 - factor) * value
            weight = factor * state.get(name + "_unbias", zeros) + (1.0 - factor)
            state[name + "_biased"], state[name + "_unbias"] = biased, weight
            state[name] = biased / weight
            return
        # Appendix B.3: a plain mean over the first 1 / (1 - smoothing) steps, then the EWMA.
        count = state.get(name + "_count", torch.zeros(1, dtype=torch.float64)) + 1
        state[name + "_count"] = count
        if count.item() < 1 / (1 - factor):
            total = state.get(name + "_total")
            state[name + "_total"] = value.clone() if total is None else total + value
            state[name] = state[name + "_total"] / count
        else:
            state[name] = factor * state[name] + (1.0 - factor) * value

    # -- the estimates and the gain ---------------------------------------------------------------------------

    @property
    def scale(self) -> float:
        """The batch relative to the baseline batch."""
        return self._scale

    @property
    def smoothing(self) -> float:
        """The EWMA factor of the estimates."""
        return self._smoothing

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Sets a new batch scale; with `update_estimate` the variance estimate is rescaled to it."""
        self._not_in_backward("set_scale")
        if scale < 1:
            raise ValueError(f"AdaScale: scale must be at least 1, got {scale}")
        if update_estimate and hasattr(self, "_scale"):
            # var is the variance of a baseline batch measured in units of the current batch: rescale it.
            ratio = self._scale / scale
            for name in ("grad_var_avg", "grad_var_avg_biased", "grad_var_avg_total"):
                if name in self._state:
                    self._state[name] = self._state[name] * ratio
        self._scale = scale

    def set_num_gradients_to_accumulate(
        self, num_gradients_to_accumulate: int, update_smoothing: bool = True
    ) -> None:
        """Sets the backward passes per step (call `set_scale` too); `update_smoothing` recomputes the default."""
        self._not_in_backward("set_num_gradients_to_accumulate")
        if num_gradients_to_accumulate < 1:
            raise ValueError(
                f"AdaScale: num_gradients_to_accumulate must be at least 1, got {num_gradients_to_accumulate}"
            )
        self._num_grads_to_accum = num_gradients_to_accumulate
        if update_smoothing:
            self._smoothing = max(1 - self._world_size * num_gradients_to_accumulate / 1000, 0)

    def _estimate(self, name: str, group: int | None) -> float:
        values = self._state[name]
        return float(values.sum() if group is None else values[group])

    def gain(self, pg_idx: int | None = None) -> float:
        """The gain ratio of parameter group `pg_idx`, or of all groups' estimates summed."""
        var = self._estimate("grad_var_avg", pg_idx)
        sqr = self._estimate("grad_sqr_avg", pg_idx)
        return (var + sqr) / (var / self._scale + sqr)

    def scale_grad_by_num_grads_to_accum(self) -> None:
        """Divides the accumulated gradients by the number of passes (for an unscaled loss, before `step`)."""
        self._not_in_backward("scale_grad_by_num_grads_to_accum")
        if self._num_grads_to_accum <= 1:
            raise RuntimeError("AdaScale.scale_grad_by_num_grads_to_accum: not accumulating gradients")
        if self._is_scaled_loss:
            raise RuntimeError(
                "AdaScale.scale_grad_by_num_grads_to_accum: is_scaled_loss=True, the loss is scaled"
            )
        for group in self._optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(self._num_grads_to_accum)

    # -- the optimizer API ------------------------------------------------------------------------------------

    def _not_in_backward(self, what: str) -> None:
        if self._local_grad_sqr is not None:
            raise RuntimeError(f"AdaScale.{what}: called in the middle of gradient accumulation")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's step with each group's learning rate multiplied by its gain, then restored."""
        self._not_in_backward("step")
        base_lrs = [group["lr"] for group in self._optimizer.param_groups]
        for index, group in enumerate(self._optimizer.param_groups):
            group["lr"] = base_lrs[index] * self.gain(index)
        try:
            return self._optimizer.step(*args, **kwargs)
        finally:
            for lr, group in zip(base_lrs, self._optimizer.param_groups):
                group["lr"] = lr

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group to the wrapped optimizer; its estimates start at sqr = 1, var = 0 (gain 1)."""
        self._not_in_backward("add_param_group")
        self._optimizer.add_param_group(param_group)
        self.unhook()
        self._hook()
        for name, value in list(self._state.items()):
            if name.endswith("_count"):
                continue  # one step counter for all groups
            start = 1.0 if name == "grad_sqr_avg" else 0.0
            self._state[name] = torch.cat([value, torch.tensor([start], dtype=value.dtype)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._not_in_backward("zero_grad")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, AdaScale's estimates included (not mid-accumulation)."""
        self._not_in_backward("state_dict")
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._not_in_backward("load_state_dict")
        self._optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"AdaScale(scale={self._scale}, {self._optimizer!r})"


class AdaScaleWrapper(AdaScale):
    """AdaScale built from parameters and an optimizer class, like a plain optimizer (so OSS can wrap it)."""

    def __init__(
        self,
        params: Any,
        world_size: int | None = None,
        scale: float | None = None,
        smoothing: float | None = None,
        num_gradients_to_accumulate: int = 1,
        debias_ewma: bool = True,
        optim_cls: type[Optimizer] = SGD,
        **additional_optim_args: Any,
    ):
        super().__init__(
            optim_cls(params, **additional_optim_args),
            world_size=world_size,
            scale=scale,
            smoothing=smoothing,
            num_gradients_to_accumulate=num_gradients_to_accumulate,
            debias_ewma=debias_ewma,
        )
