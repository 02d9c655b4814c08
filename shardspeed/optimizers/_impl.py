"""Shared helpers for the optimizers: choosing torch's fused or foreach kernels, low-precision params
updated through fp32 working copies, and what every DeepSpeed-named class in `shardspeed.ops` adds to its
backing optimizer (the AMSGrad refusal, `set_grad_none`, `step(closure, fp16_param_groups)`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def _fused_devices() -> tuple[str, ...]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except (ImportError, AttributeError):  # private helper moved: fall back to the devices known today
        return ("cuda", "cpu", "xpu", "mps", "hpu")


def materialize(params: Any) -> list:
    """`params` (tensors, (name, tensor) pairs or param-group dicts, possibly generators) as a list whose
    groups hold lists, so they can be inspected before torch's Optimizer consumes them."""
    if isinstance(params, torch.Tensor):
        return [params]
    items = list(params)
    return [
        dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
        if isinstance(g, dict) and "params" in g
        else g
        for g in items
    ]


def iter_group_tensors(param_groups: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor in a materialized list of tensors, (name, tensor) pairs or param-group dicts."""
    for item in param_groups:
        if isinstance(item, dict):
            for p in item.get("params", []):
                yield p[1] if isinstance(p, tuple) else p
        elif isinstance(item, tuple):
            yield item[1]
        elif isinstance(item, torch.Tensor):
            yield item


def can_use_fused(param_groups: Iterable[Any], devices: tuple[str, ...] | None = None) -> bool:
    """True when a torch fused optimizer kernel can run every parameter: dense floating tensors on a device
    with fused kernels (`devices`, default: every device torch has them for). On CPU, torch 2.13's fused
    Adam/AdamW and Adagrad matched their foreach versions within 2.4e-7 over 20-50 steps in our check, so
    they are used there too."""
    devices = devices or _fused_devices()
    tensors = list(iter_group_tensors(param_groups))
    return bool(tensors) and all(
        t.is_floating_point() and not t.is_sparse and t.device.type in devices for t in tensors
    )


def kernel_choice(param_groups: Iterable[Any], devices: tuple[str, ...] | None = None) -> dict[str, bool]:
    """torch's `fused=True` where `can_use_fused` allows it, else `foreach=True`: the keyword to pass to a
    torch optimizer's constructor."""
    return {"fused": True} if can_use_fused(param_groups, devices) else {"foreach": True}


def run_closure(closure: Callable[[], float] | None) -> Any:
    """The loss from `closure` (run with gradients on, as torch's optimizers do), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def params_with_grads(group: dict, optimizer_name: str) -> list[torch.Tensor]:
    """The params of `group` that have a gradient; RuntimeError for a sparse one (the foreach update is dense)."""
    params = [p for p in group["params"] if p.grad is not None]
    for p in params:
        if p.grad.is_sparse:
            raise RuntimeError(f"{optimizer_name} does not support sparse gradients")
    return params


def working_copies(tensors: list[torch.Tensor], dtype_of: list[torch.dtype]) -> list[torch.Tensor]:
    """`tensors` cast to the matching dtypes; tensors already in that dtype are returned as themselves, so
    in-place updates of the common all-fp32 case touch the real tensors with no copy."""
    return [t if t.dtype == d else t.to(d) for t, d in zip(tensors, dtype_of)]


def write_back(params: list[torch.Tensor], work: list[torch.Tensor]) -> None:
    """Copy the fp32 working copies made by `working_copies` back into their low-precision params."""
    for p, w in zip(params, work):
        if w is not p:
            p.copy_(w)


def state_dtype(param: torch.Tensor, fp32_states: bool) -> torch.dtype:
    """The dtype of optimizer state for `param`: fp32 for 16-bit params when asked, else the param's own."""
    if fp32_states and param.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return param.dtype


def check_betas(betas: Any) -> tuple[float, float]:
    """`betas` as a tuple of two floats in [0, 1); ValueError otherwise."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    b1, b2 = (float(b) for b in betas)
    for i, b in enumerate((b1, b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} (must be in [0, 1))")
    return b1, b2


def check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0.0:
            raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def copy_to_half_groups(param_groups: list[dict], half_groups) -> None:
    """Copy every updated parameter into its low-precision twin: `half_groups` holds one tensor or list of
    tensors per param group, in the same order (DeepSpeed's `fp16_param_groups`)."""
    if isinstance(half_groups, torch.Tensor):
        half_groups = [half_groups]
    for group, halves in zip(param_groups, half_groups):
        halves = [halves] if isinstance(halves, torch.Tensor) else halves
        for param, half in zip(group["params"], halves):
            half.copy_(param)


class UnsupportedOptionError(ValueError, RuntimeError):
    """An option DeepSpeed's optimizer refuses too (amsgrad). Both a ValueError and a RuntimeError, so code
    written against either of DeepSpeed's exception types keeps catching it."""


def refuse_amsgrad(amsgrad: bool, optimizer_name: str) -> None:
    """DeepSpeed's optimizers refuse `amsgrad=True`; so do their shardspeed twins, with DeepSpeed's words."""
    if amsgrad:
        raise UnsupportedOptionError(f"{optimizer_name} does not support the AMSGrad variant.")


# --- what DeepSpeed's classes add to their backing optimizer: mixins placed before it in the bases ---------


class GradNoneByDefault:
    """DeepSpeed's `set_grad_none` (the GPU classes: default True): `zero_grad()` without an argument sets
    gradients to None when it is true, zeroes them otherwise. The subclass sets `self.set_grad_none`."""

    set_grad_none: bool = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class HalfGroupsStep:
    """DeepSpeed's CPU classes' `step(closure=None, fp16_param_groups=None)`: the update of the backing
    optimizer, then a copy of the new values into `fp16_param_groups` when given. A subclass that changes
    how the backing update runs overrides `_backing_step`, keeping this one signature."""

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One step; `fp16_param_groups` (DeepSpeed's argument) receives a copy of the new values."""
        loss = self._backing_step(closure)
        if fp16_param_groups is not None:
            copy_to_half_groups(self.param_groups, fp16_param_groups)
        return loss

    def _backing_step(self, closure):
        return super().step(closure)
