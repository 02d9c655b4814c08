"""`FusedLion` and `DeepSpeedCPULion` with DeepSpeed's signatures, backed by `shardspeed.optimizers.Lion`.

DeepSpeed's classes default to `betas=(0.9, 0.999)` (not the paper's 0.99); these keep DeepSpeed's defaults.
"""

from __future__ import annotations

from shardspeed.optimizers._impl import GradNoneByDefault, HalfGroupsStep
from shardspeed.optimizers.lion import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(GradNoneByDefault, Lion):
    """DeepSpeed's GPU Lion; here the foreach implementation of `Lion` on any device.

    `set_grad_none` (default True) makes `zero_grad()` set gradients to None rather than zero them.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none


class DeepSpeedCPULion(HalfGroupsStep, Lion):
    """DeepSpeed's SIMD CPU Lion (ZeRO-Offload); here `Lion` on the parameters' own device.

    `fp32_optimizer_states` (default True) keeps the momentum in fp32 for fp16/bf16 parameters.
    """

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            fp32_optimizer_states=fp32_optimizer_states,
        )
