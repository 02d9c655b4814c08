"""`FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's signatures, backed by `torch.optim.Adam`.

Both subclass `torch.optim.Adam` with `decoupled_weight_decay=adam_w_mode` (torch's AdamW update) and use
torch's fused kernel where every parameter is on a device that has one (CPU included), else foreach. Two
DeepSpeed options torch cannot express run through a foreach implementation of the same update, with state
in torch's layout (`step`, `exp_avg`, `exp_avg_sq`) so checkpoints stay interchangeable:
`bias_correction=False`, and `fp32_optimizer_states=True` for fp16/bf16 parameters (DeepSpeedCPUAdam).
"""

from __future__ import annotations

import math

import torch

from shardspeed.ops.adam_subgroups import SubgroupSteps
from shardspeed.optimizers._impl import (
    GradNoneByDefault,
    HalfGroupsStep,
    check_betas,
    kernel_choice,
    materialize,
    refuse_amsgrad,
    run_closure,
    state_dtype,
    working_copies,
    write_back,
)

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class _TorchBackedAdam(torch.optim.Adam):
    """torch's Adam/AdamW plus DeepSpeed's `bias_correction` and fp32 optimizer states."""

    def __init__(self, params, *, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw, fp32_states):
        refuse_amsgrad(amsgrad, type(self).__name__)
        params = materialize(params)
        super().__init__(
            params,
            lr=lr,
            betas=check_betas(betas),
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adamw,
            **kernel_choice(params),
        )
        self.defaults["bias_correction"] = bias_correction
        for group in self.param_groups:
            group.setdefault("bias_correction", bias_correction)
        self.fp32_optimizer_states = fp32_states

    def _needs_own_update(self) -> bool:
        """True when torch's kernels cannot do what was asked (see the module docstring)."""
        for group in self.param_groups:
            if not group.get("bias_correction", True):
                return True
            if self.fp32_optimizer_states and any(state_dtype(p, True) != p.dtype for p in group["params"]):
                return True
        return False

    @torch.no_grad()
    def step(self, closure=None):
        if not self._needs_own_update():
            return super().step(closure)
        loss = run_closure(closure)
        for group in self.param_groups:
            self._own_update(group)
        return loss

    def _own_update(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                dtype = state_dtype(p, self.fp32_optimizer_states)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["step"] += 1
        states = [self.state[p] for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        dtypes = [m.dtype for m in exp_avgs]
        work = working_copies(params, dtypes)
        grads = working_copies([p.grad for p in params], dtypes)
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                torch._foreach_mul_(work, 1.0 - lr * weight_decay)
            else:
                grads = torch._foreach_add(grads, work, alpha=weight_decay)

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        steps = [float(s["step"]) for s in states]  # CPU scalars: no device sync
        if group["bias_correction"]:
            torch._foreach_div_(denom, [math.sqrt(1.0 - beta2**t) for t in steps])
            step_sizes = [-lr / (1.0 - beta1**t) for t in steps]
        else:
            step_sizes = [-lr] * len(steps)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(work, exp_avgs, denom, step_sizes)
        write_back(params, work)


class FusedAdam(GradNoneByDefault, _TorchBackedAdam):
    """DeepSpeed's multi-tensor GPU Adam; here torch's fused (or foreach) Adam/AdamW on any device.

    `adam_w_mode=True` (default) is AdamW's decoupled weight decay, False is Adam with L2 decay added to the
    gradient. `set_grad_none` (default True) makes `zero_grad()` set gradients to None. `amsgrad=True` raises.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ):
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adamw=adam_w_mode,
            fp32_states=False,
        )
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(SubgroupSteps, HalfGroupsStep, _TorchBackedAdam):
    """DeepSpeed's SIMD CPU Adam for ZeRO-Offload; here torch's fused CPU Adam/AdamW (the same math).

    `step_subgroup(i)` / `rollback_subgroup(i)` step and undo one ZeRO-3 offload sub-group with the state kept
    under its number (ops/adam_subgroups.py).

    `adamw_mode=True` (default) is AdamW. `fp32_optimizer_states=True` (default) keeps `exp_avg` and
    `exp_avg_sq` in fp32 for fp16/bf16 parameters and does the update in fp32. `amsgrad=True` raises.
    """

    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
    ):
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adamw=adamw_mode,
            fp32_states=fp32_optimizer_states,
        )
        self.adam_w_mode = adamw_mode
