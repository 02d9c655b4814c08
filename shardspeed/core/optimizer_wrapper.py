"""The optimizer-wrapper protocol the engine drives, shared by stage 0 and the ZeRO stages.

A wrapper owns the gradients, the fp32 masters and the step of one stage. The engine calls
`backward_begin(is_boundary)`, `backward_end()`, `step() -> applied`, `zero_grad()`, `state_dict()`,
`load_state_dict()`, `load_universal()` and `remove_hooks()`; users see `param_groups` and the loss scale,
as on DeepSpeed's optimizer wrappers. `optimizer` is the wrapped torch optimizer.
"""

from __future__ import annotations

import math

from shardspeed.core.precision import step_multiplier


class OptimizerWrapper:
    optimizer = None  # the torch optimizer
    scaler = None  # the LossScaler
    clip = 0.0  # gradient_clipping
    # Combines this wrapper's norm with the rest of the model's when the model is split across ranks that do
    # not share gradients (pipeline stages): `hook(norm) -> global norm`, called collectively on every rank.
    global_norm_hook = None
    # `zero_optimization.compute_grad_norm: false` (stages 1-2, no clipping): no norm is taken; a step is
    # still skipped on inf/nan gradients where the scaler checks for them. `grad_norm` is then None.
    compute_grad_norm = True
    # What the step multiplies this wrapper's reduced gradients by before using them (an MoE expert domain:
    # edp / dp, moe/optimizer.py); the gradient accessors (safe_get_full_grad, ...) apply it, so they show
    # and take the gradient the step uses.
    gradient_scale = 1.0

    def step(self) -> bool:
        """Apply the optimizer at an accumulation boundary. Returns False when an overflow skipped it."""
        multiplier = self._step_multiplier()
        if multiplier is None:
            return False
        self._apply(multiplier)
        self.scaler.update(False)
        self.zero_grad()
        return True

    def _step_multiplier(self) -> float | None:
        """Decide this boundary's step: take the norm (or only check for inf/nan without one), let the loss
        scaler see it, and return what the gradients are multiplied by (unscale and clip). None when the step is
        skipped (an overflow: the gradients are already zeroed). Wrappers with their own step (ZenFlow's) start
        from here, so the skip rule is one rule."""
        if self.compute_grad_norm:
            norm = self._global_norm()
            if self.global_norm_hook is not None:
                norm = self.global_norm_hook(norm)
        else:
            norm = math.inf if self.scaler.check_overflow and self._has_nonfinite() else 0.0
        self.overflow, self.grad_norm, multiplier = step_multiplier(norm, self.scaler, self.clip)
        if not self.compute_grad_norm:
            self.grad_norm = None
        if self.overflow:
            self.zero_grad()
            return None
        return multiplier

    @property
    def _global_grad_norm(self) -> float | None:
        """DeepSpeed's attribute: the global gradient norm the last step took (unscaled, before clipping;
        `engine.get_global_grad_norm()`); None before the first step or without `compute_grad_norm`."""
        return getattr(self, "grad_norm", None)

    def _global_norm(self) -> float:
        """L2 norm of the averaged, still loss-scaled gradients across all ranks (inf/nan on overflow)."""
        raise NotImplementedError

    def _has_nonfinite(self) -> bool:
        """True when any rank's gradients hold inf or nan (collective)."""
        return not math.isfinite(self._global_norm())

    def _apply(self, multiplier: float) -> None:
        """Scale the gradients by `multiplier`, step the torch optimizer, publish the new parameters."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The torch optimizer's per-parameter state (of this rank's shards under ZeRO), as DeepSpeed's."""
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.scaler.loss_scale
