"""DeepSpeed's `DeepSpeedCPUAdam.step_subgroup` / `rollback_subgroup`: one Adam step, and its exact undo, on
a ZeRO-3 offload sub-group whose state is kept under the sub-group's number.

ZeRO-3 with CPU offload steps one flat fp32 partition (a sub-group) at a time and, when a later check finds
an overflow, rolls that step back instead of keeping a copy of the old values. So `step_subgroup(i)` updates
the one parameter that has a gradient with the state `optimizer.state[i]`, and `rollback_subgroup(i)` runs
the same update backwards from the same gradient: the parameter and both moments return to their values
before the step (up to rounding) and the step count drops by one.
"""

from __future__ import annotations

import math

import torch

from shardspeed.optimizers._impl import run_closure, state_dtype

__all__ = ["SubgroupSteps"]


class SubgroupSteps:
    """Mixed into DeepSpeedCPUAdam (torch's Adam underneath: `param_groups`, `state`, `fp32_optimizer_states`)."""

    def _subgroup_param(self, subgroup_id) -> tuple[dict, torch.Tensor] | None:
        """The sub-group's one parameter with a gradient, and its group. A sub-group is one flat partition:
        with several parameters holding gradients one state cannot serve them all, so that is refused."""
        found = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if len(found) > 1:
            raise ValueError(
                f"step_subgroup({subgroup_id}): {len(found)} parameters have gradients; a sub-group is one flat "
                "partition (one parameter with a gradient), as ZeRO-3 offload sets it before each call"
            )
        return found[0] if found else None

    @staticmethod
    def _factors(group: dict, step: int) -> tuple[float, float]:
        """Bias corrections of the first and second moment at `step` (1 without bias correction)."""
        beta1, beta2 = group["betas"]
        if not group.get("bias_correction", True):
            return 1.0, 1.0
        return 1.0 - beta1**step, 1.0 - beta2**step

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure=None):
        """One Adam(W) step of the sub-group's parameter with the state `self.state[subgroup_id]`."""
        loss = run_closure(closure)
        found = self._subgroup_param(subgroup_id)
        if found is None:
            return loss
        group, param = found
        state = self.state[subgroup_id]
        dtype = state_dtype(param, self.fp32_optimizer_states)
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        weight, grad = param.detach().to(dtype), param.grad.detach().to(dtype)
        if decay and group["decoupled_weight_decay"]:
            weight.mul_(1.0 - lr * decay)
        elif decay:
            grad = grad.add(weight, alpha=decay)
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        first, second = self._factors(group, state["step"])
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(second)).add_(group["eps"])
        weight.addcdiv_(state["exp_avg"], denom, value=-lr / first)
        param.copy_(weight)
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure=None):
        """Undo the last `step_subgroup(sub_group_id)`, from the same gradient."""
        loss = run_closure(closure)
        state = self.state.get(sub_group_id) if sub_group_id in self.state else None
        if not state:
            raise RuntimeError(
                f"Cannot rollback optimizer state for sub_group_id {sub_group_id} as it has not been initialized."
            )
        if state.get("step", 0) <= 0:
            raise RuntimeError(
                f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}"
            )
        found = self._subgroup_param(sub_group_id)
        if found is None:
            return loss
        group, param = found
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        dtype = state["exp_avg"].dtype
        weight, grad = param.detach().to(dtype), param.grad.detach().to(dtype)
        # the update backwards: add the step back, then undo the decoupled decay
        first, second = self._factors(group, state["step"])
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(second)).add_(group["eps"])
        weight.addcdiv_(state["exp_avg"], denom, value=lr / first)
        if decay and group["decoupled_weight_decay"]:
            weight.div_(1.0 - lr * decay)
        elif decay:  # L2 decay entered the moments through the gradient at the old weight
            grad = grad.add(weight, alpha=decay)
        state["exp_avg"].sub_(grad, alpha=1.0 - beta1).div_(beta1)
        state["exp_avg_sq"].addcmul_(grad, grad, value=-(1.0 - beta2)).div_(beta2).clamp_(min=0.0)
        state["step"] -= 1
        param.copy_(weight)
        return loss
