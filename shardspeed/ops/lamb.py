"""`FusedLamb` with DeepSpeed's signature, backed by `shardspeed.optimizers.Lamb` (same update rule)."""

from __future__ import annotations

from shardspeed.optimizers._impl import refuse_amsgrad
from shardspeed.optimizers.lamb import Lamb
from shardspeed.utils.logging import logger

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """DeepSpeed's fused LAMB; here the foreach implementation of `Lamb` on any device.

    `max_grad_norm` is accepted for signature compatibility and ignored with a warning: DeepSpeed's kernel
    only clips when its caller passes gradient norms to `step()`. Clip with the engine's `gradient_clipping`.
    `amsgrad=True` raises, as in DeepSpeed.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        amsgrad=False,
    ):
        refuse_amsgrad(amsgrad, "FusedLamb")
        if max_grad_norm:
            logger.warning(
                "FusedLamb: max_grad_norm=%s is ignored; use the config's top-level gradient_clipping",
                max_grad_norm,
            )
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
