"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") in pure PyTorch.

Per parameter, with gradient g and momentum m:

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)      # decoupled weight decay, then the sign step
    m = beta2 * m + (1 - beta2) * g

One state tensor per parameter (`exp_avg`), half of Adam's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardspeed.optimizers._impl import (
    check_betas,
    check_non_negative,
    params_with_grads,
    run_closure,
    state_dtype,
    working_copies,
    write_back,
)


class Lion(torch.optim.Optimizer):
    """Lion with the paper's defaults (`betas=(0.9, 0.99)`; use a 3-10x smaller lr than AdamW).

    `fp32_optimizer_states=True` keeps `exp_avg` in fp32 for fp16/bf16 parameters and does the update
    in fp32 (costs one fp32 copy of those parameters per step).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        fp32_optimizer_states: bool = False,
    ) -> None:
        check_non_negative(learning_rate=lr, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=check_betas(betas), weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = run_closure(closure)
        for group in self.param_groups:
            self._update_group(group)
        return loss

    def _update_group(self, group: dict) -> None:
        params = params_with_grads(group, "Lion")
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p, self.fp32_optimizer_states))
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        dtypes = [m.dtype for m in exp_avgs]
        work = working_copies(params, dtypes)
        grads = working_copies([p.grad for p in params], dtypes)
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]

        update = torch._foreach_mul(exp_avgs, beta1)
        torch._foreach_add_(update, grads, alpha=1.0 - beta1)
        torch._foreach_sign_(update)
        if weight_decay != 0:
            torch._foreach_mul_(work, 1.0 - lr * weight_decay)
        torch._foreach_add_(work, update, alpha=-lr)
        torch._foreach_mul_(exp_avgs, beta2)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
        write_back(params, work)
