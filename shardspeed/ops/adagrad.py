"""`DeepSpeedCPUAdagrad` with DeepSpeed's signature, backed by `torch.optim.Adagrad` (fused on CPU, else
foreach)."""

from __future__ import annotations

import torch

from shardspeed.optimizers._impl import (
    UnsupportedOptionError,
    can_use_fused,
    copy_to_half_groups,
    materialize,
)

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's SIMD CPU Adagrad (ZeRO-Offload): `sum += g^2; p -= lr * g / (sqrt(sum) + eps)`, with L2
    weight decay added to the gradient. Here torch's Adagrad (no lr decay, zero initial accumulator).

    `fp32_optimizer_states` is accepted for compatibility; torch keeps Adagrad's state in the parameter's
    dtype, which is fp32 whenever the engine drives it (it updates fp32 master weights).
    `amsgrad=True` raises, as in DeepSpeed.
    """

    def __init__(
        self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True
    ):
        if amsgrad:
            raise UnsupportedOptionError("DeepSpeedCPUAdagrad does not support the AMSGrad variant.")
        model_params = materialize(model_params)
        # torch's fused Adagrad exists for CPU only.
        kernel = {"fused": True} if can_use_fused(model_params, ("cpu",)) else {"foreach": True}
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, **kernel)
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One Adagrad step; `fp16_param_groups` (DeepSpeed's argument) receives a copy of the new values.
        Sparse gradients (an `nn.Embedding(sparse=True)`) take torch's per-tensor path for that step: the
        fused and foreach kernels refuse them."""
        if any(p.grad is not None and p.grad.is_sparse for g in self.param_groups for p in g["params"]):
            kernels = [(g["fused"], g["foreach"]) for g in self.param_groups]
            for g in self.param_groups:
                g["fused"], g["foreach"] = None, False
            try:
                loss = super().step(closure)
            finally:
                for g, (fused, foreach) in zip(self.param_groups, kernels):
                    g["fused"], g["foreach"] = fused, foreach
        else:
            loss = super().step(closure)
        if fp16_param_groups is not None:
            copy_to_half_groups(self.param_groups, fp16_param_groups)
        return loss
