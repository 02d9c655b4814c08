"""LAMB (You et al. 2019) in pure PyTorch, with the semantics of DeepSpeed's FusedLamb kernel.

Per parameter tensor p with gradient g, at step t (counted per parameter):

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    denom = sqrt(v) + eps                   (sqrt(v + eps) when eps_inside_sqrt)
    update = m / denom + weight_decay * p   (m, v *not* bias-corrected here)
    trust = ||p|| / ||update||, clamped to [min_coeff, max_coeff]; 1 if either norm is 0
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)   (lr when bias_correction is False)
    p = p - step_size * trust * update

As in DeepSpeed, the bias correction enters only through `step_size`, so the trust ratio is computed on the
uncorrected update. The norms are per tensor: under ZeRO's flat partitions they would become per-shard norms,
which is why LAMB is not among the ZeRO-tested optimizers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from shardspeed.optimizers._impl import check_betas, check_non_negative, params_with_grads, run_closure


class Lamb(torch.optim.Optimizer):
    """LAMB with DeepSpeed FusedLamb's options (see the module docstring for the update)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        check_non_negative(learning_rate=lr, epsilon=eps, weight_decay=weight_decay, min_coeff=min_coeff)
        if max_coeff < min_coeff:
            raise ValueError(f"max_coeff ({max_coeff}) must be >= min_coeff ({min_coeff})")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=check_betas(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._last_trust_ratios: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio applied to each updated parameter in the last step (as DeepSpeed's FusedLamb).
        Reading them is a device-to-host sync."""
        return [ratio for ratios in self._last_trust_ratios for ratio in ratios.tolist()]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = run_closure(closure)
        self._last_trust_ratios = []
        for group in self.param_groups:
            self._update_group(group)
        return loss

    def _update_group(self, group: dict) -> None:
        params = params_with_grads(group, "Lamb")
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
        # The trust ratios are stacked per device so that each device computes them in one go.
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            by_device[p.device].append(p)
        for device_params in by_device.values():
            self._last_trust_ratios.append(self._update_tensors(group, device_params))

    def _update_tensors(self, group: dict, params: list[torch.Tensor]) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["eps_inside_sqrt"]:
            denom = torch._foreach_add(exp_avg_sqs, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avgs, denom)
        if group["weight_decay"] != 0:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])

        weight_norms = torch.stack([n.float() for n in torch._foreach_norm(params)])
        update_norms = torch.stack([n.float() for n in torch._foreach_norm(update)])
        trust = torch.where(
            (weight_norms > 0) & (update_norms > 0),
            (weight_norms / update_norms).clamp(group["min_coeff"], group["max_coeff"]),
            torch.ones_like(weight_norms),
        )
        step_sizes = torch.tensor(
            [self._step_size(group, s["step"]) for s in states], dtype=torch.float32, device=trust.device
        )
        scales = (trust * step_sizes).unbind()
        torch._foreach_mul_(update, [s.to(u.dtype) for s, u in zip(scales, update)])
        torch._foreach_sub_(params, update)
        return trust

    @staticmethod
    def _step_size(group: dict, step: int) -> float:
        if not group["bias_correction"]:
            return group["lr"]
        beta1, beta2 = group["betas"]
        return group["lr"] * (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
