"""`DeepSpeedCPUAdagrad` with DeepSpeed's signature, backed by `torch.optim.Adagrad` (fused on CPU, else
foreach)."""

from __future__ import annotations

import torch

from shardspeed.optimizers._impl import HalfGroupsStep, kernel_choice, materialize, refuse_amsgrad

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(HalfGroupsStep, torch.optim.Adagrad):
    """DeepSpeed's SIMD CPU Adagrad (ZeRO-Offload): `sum += g^2; p -= lr * g / (sqrt(sum) + eps)`, with L2
    weight decay added to the gradient. Here torch's Adagrad (no lr decay, zero initial accumulator).

    `fp32_optimizer_states` is accepted for compatibility; torch keeps Adagrad's state in the parameter's
    dtype, which is fp32 whenever the engine drives it (it updates fp32 master weights).
    `amsgrad=True` raises, as in DeepSpeed.
    """

    def __init__(
        self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True
    ):
        refuse_amsgrad(amsgrad, "DeepSpeedCPUAdagrad")
        model_params = materialize(model_params)
        # torch's fused Adagrad exists for CPU only.
        kernel = kernel_choice(model_params, ("cpu",))
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, **kernel)
        self.fp32_optimizer_states = fp32_optimizer_states

    def _backing_step(self, closure):
        """torch's Adagrad step. Sparse gradients (an `nn.Embedding(sparse=True)`) take torch's per-tensor
        path for that step: the fused and foreach kernels refuse them."""
        if not any(p.grad is not None and p.grad.is_sparse for g in self.param_groups for p in g["params"]):
            return super()._backing_step(closure)
        kernels = [(g["fused"], g["foreach"]) for g in self.param_groups]
        for g in self.param_groups:
            g["fused"], g["foreach"] = None, False
        try:
            return super()._backing_step(closure)
        finally:
            for g, (fused, foreach) in zip(self.param_groups, kernels):
                g["fused"], g["foreach"] = fused, foreach
