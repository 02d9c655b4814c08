"""`torch_autocast`: the engine's forward under `torch.autocast`, with DeepSpeed 0.19's semantics.

The module's parameters stay fp32 (the fp16/bf16 blocks must be off) and torch.autocast runs the eligible
operations in the configured dtype. The parameters of the *lower-precision-safe* modules (by default torch's
Linear and Conv1d/2d/3d; `lower_precision_safe_modules` names others by ``package.Class``) are marked with
DeepSpeed's `comm_dtype` attribute: their gradients are reduced across ranks in the autocast dtype, every
other gradient in fp32 (the gradient buckets split by that mark, runtime/grad_buckets.py). An fp16 autocast
scales the loss with the dynamic loss scaler (runtime/precision.py).

An autocast the caller opened around `engine(...)` is overridden: inside the engine's forward autocast
follows the config, switched off when `torch_autocast` is not enabled (as DeepSpeed does; its fp16/bf16
blocks then decide the precision).
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn

from shardspeed.core.precision import DTYPES
from shardspeed.utils.logging import log_dist

__all__ = ["DEFAULT_SAFE_MODULES", "TorchAutocast"]

DEFAULT_SAFE_MODULES = tuple(
    f"{c.__module__}.{c.__name__}" for c in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
)


def _import_class(path: str) -> type:
    package, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(package), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"torch_autocast.lower_precision_safe_modules: cannot import {path!r} ({err}); give module classes "
            "as 'package.module.Class', e.g. 'torch.nn.modules.linear.Linear'"
        ) from None


class TorchAutocast:
    """The engine's autocast part: marks gradient communication dtypes once, then wraps each forward."""

    def __init__(self, enabled: bool, device_type: str, dtype: torch.dtype | None = None):
        self.enabled = enabled
        self.device_type = device_type
        # torch's own default for the device (bf16 on CPU, fp16 on CUDA) when the config names none
        self.dtype = dtype if dtype is not None else torch.get_autocast_dtype(device_type)
        self._warned = False

    @classmethod
    def from_config(cls, config, module: nn.Module, device: torch.device) -> TorchAutocast:
        block = config.torch_autocast
        part = cls(block.enabled, device.type, DTYPES[block.dtype] if block.dtype else None)
        if block.enabled:
            part.mark_safe_modules(module, block.lower_precision_safe_modules)
        return part

    def mark_safe_modules(self, module: nn.Module, names: list[str] | None) -> None:
        """Give the direct parameters of every lower-precision-safe module the `comm_dtype` mark."""
        classes = tuple(_import_class(n) for n in (names if names is not None else DEFAULT_SAFE_MODULES))
        for sub in module.modules():
            if type(sub) in classes:
                for p in sub.parameters(recurse=False):
                    p.comm_dtype = self.dtype

    def context(self):
        """The autocast state the forward runs in."""
        outer = torch.is_autocast_enabled(self.device_type)
        if outer and not self._warned:
            self._warned = True
            log_dist(
                "torch.autocast is active around the engine's forward; inside it the engine follows the config's "
                f"torch_autocast block ({'enabled' if self.enabled else 'disabled'})",
                ranks=[0],
                level=30 if not self.enabled else 20,
            )
        if self.enabled:
            return torch.autocast(device_type=self.device_type, dtype=self.dtype, enabled=True)
        if outer:
            return torch.autocast(device_type=self.device_type, enabled=False)
        return contextlib.nullcontext()
