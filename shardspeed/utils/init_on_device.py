"""`OnDevice` (DeepSpeed's `deepspeed.OnDevice`): build modules directly on a device and in a dtype.

    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        model = MyModel()          # parameters are fp16 meta tensors: no memory, no initialisation cost

torch already has both halves: `torch.device(...)` as a context manager makes factory functions and module
parameters default to that device, and the default dtype decides floating-point parameters' dtype.
DeepSpeed patches `torch.Tensor.__new__` and four factory functions instead; the observable result is the
same for modules (floating-point tensors in `dtype`, every tensor on `device`).
"""

from __future__ import annotations

import torch

__all__ = ["OnDevice"]


class OnDevice:
    """Create tensors and modules on `device` (default "meta") with floating-point dtype `dtype`."""

    def __init__(self, dtype: torch.dtype, device="meta", enabled: bool = True) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"OnDevice(dtype=...): expected a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._device_context = None
        self._saved_dtype = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        if self.dtype is not None:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc) -> bool:
        if not self.enabled:
            return False
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None
        self._device_context.__exit__(*exc)
        self._device_context = None
        return False
