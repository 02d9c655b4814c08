"""DeepSpeed's `safe_get_local_*` / `safe_set_local_*` / `safe_set_full_*` accessors over ZeRO shards.

"Local" is this rank's part of a parameter: the fragment of it inside this rank's shard of its bucket or
unit (a flat 1-D tensor, possibly empty), as DeepSpeed's ZeRO-3 accessors return it. The local getters and
setters touch only this rank and need no collective; `safe_set_full_grad` / `safe_set_full_optimizer_state`
take the full value on every rank and each rank keeps its own fragment. DeepSpeed defines the local ones for
ZeRO-3 only; here they work at stages 1-3 (every stage keeps flat shards), and at stage 0 the local part is
the whole parameter. A parameter no ZeRO engine manages is refused with a ValueError naming the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from shardspeed.zero.api import safe_get_full_grad

__all__ = [
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def _owner(param: nn.Parameter, call: str):
    owner = getattr(param, "_shardspeed_zero", None)
    if owner is None:
        raise ValueError(
            f"{call}: the parameter (shape {tuple(param.shape)}) is not managed by a shardspeed engine"
        )
    return owner


def _fragment(wrapper, index: int, param: nn.Parameter) -> tuple[int, int, int] | None:
    """(start in the parameter, start in this rank's shard, length) of `param` in its shard, or None."""
    bucket = wrapper.buckets[index]
    i = next(k for k, p in enumerate(bucket.params) if p is param)
    for j, _, in_param, in_shard, length in bucket.fragments():
        if j == i:
            return in_param, in_shard, length
    return None


def _local(shard: torch.Tensor, fragment) -> torch.Tensor:
    if fragment is None:
        return shard.new_empty(0)
    _, start, length = fragment
    return shard[start : start + length]


def _write(shard: torch.Tensor, fragment, value: torch.Tensor, call: str) -> None:
    target = _local(shard, fragment)
    if value.numel() != target.numel():
        raise ValueError(f"{call}: value has {value.numel()} elements, this rank's part has {target.numel()}")
    target.copy_(value.reshape(-1))


def _gradient_shard(wrapper, index: int, call: str) -> torch.Tensor:
    if getattr(wrapper, "_grads_on_nvme", False):
        raise NotImplementedError(f"{call}: gradients offloaded to NVMe are read-only through this call")
    return wrapper.gradient_shard(index)


def _set_whole_gradient(wrapper, param: nn.Parameter, value: torch.Tensor) -> None:
    """Stage 0: the local part is the whole parameter, its gradient the bucket slice the step reads."""
    wrapper.gradient_of(param).copy_(value.reshape(param.shape))


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of `param`'s reduced gradient (in the gradient-accumulation dtype), as the step will
    use it."""
    wrapper, index = _owner(param, "safe_get_local_grad")
    if index is None:
        grad = wrapper.gradient_of(param)
        return None if grad is None else grad.detach() * wrapper.gradient_scale
    return _local(wrapper.gradient_shard(index), _fragment(wrapper, index, param)) * wrapper.gradient_scale


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's part of `param`'s reduced gradient (before `engine.step()`)."""
    wrapper, index = _owner(param, "safe_set_local_grad")
    value = value / wrapper.gradient_scale
    if index is None:
        return _set_whole_gradient(wrapper, param, value)
    shard = _gradient_shard(wrapper, index, "safe_set_local_grad")
    _write(shard, _fragment(wrapper, index, param), value, "safe_set_local_grad")


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite `param`'s gradient with the full `value` (given on every rank; each keeps its part)."""
    wrapper, index = _owner(param, "safe_set_full_grad")
    value = value / wrapper.gradient_scale
    if index is None:
        return _set_whole_gradient(wrapper, param, value)
    fragment = _fragment(wrapper, index, param)
    piece = value.reshape(-1)[fragment[0] : fragment[0] + fragment[2]] if fragment else value.new_empty(0)
    _write(_gradient_shard(wrapper, index, "safe_set_full_grad"), fragment, piece, "safe_set_full_grad")


def safe_update_full_grad_vectorized(param_list: list[nn.Parameter], update_func: Callable) -> None:
    """`update_func(full_grad, param)` -> new full gradient, applied to each parameter of `param_list`."""
    for param in param_list:
        old = safe_get_full_grad(param)
        if old is not None:
            safe_set_full_grad(param, update_func(old, param))


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of `param`'s fp32 master value."""
    wrapper, index = _owner(param, "safe_get_local_fp32_param")
    if index is None:
        return wrapper.masters.get(param, param.detach()).float().clone()
    with wrapper._resident_state([index]):
        return _local(wrapper.masters[index], _fragment(wrapper, index, param)).clone()


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's part of `param`'s fp32 master (and of the parameter itself)."""
    wrapper, index = _owner(param, "safe_set_local_fp32_param")
    if index is None:
        wrapper.masters.get(param, param.data).copy_(value.reshape(param.shape))
        param.data.copy_(value.reshape(param.shape))
        return
    fragment = _fragment(wrapper, index, param)
    with wrapper._resident_state([index]):
        _write(wrapper.masters[index], fragment, value, "safe_set_local_fp32_param")
        _write(wrapper.buckets[index].shard, fragment, value, "safe_set_local_fp32_param")


def _resident(wrapper, index):
    """Stages 1-3 under NVMe offload: bucket `index`'s master and state in memory for the duration."""
    return contextlib.nullcontext() if index is None else wrapper._resident_state([index])


def _state(wrapper, index, param, key: str, call: str) -> torch.Tensor:
    master = wrapper.masters[index] if index is not None else wrapper.masters.get(param, param)
    state = wrapper.optimizer.state.get(master, {})
    if key not in state:
        raise KeyError(f"{call}: no optimizer state {key!r} (present: {sorted(state)})")
    return state[key]


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of `param`'s optimizer state `optim_state_key` (e.g. "exp_avg")."""
    wrapper, index = _owner(param, "safe_get_local_optimizer_state")
    with _resident(wrapper, index):
        state = _state(wrapper, index, param, optim_state_key, "safe_get_local_optimizer_state")
        return state.clone() if index is None else _local(state, _fragment(wrapper, index, param)).clone()


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite this rank's part of `param`'s optimizer state `optim_state_key`."""
    wrapper, index = _owner(param, "safe_set_local_optimizer_state")
    with _resident(wrapper, index):
        state = _state(wrapper, index, param, optim_state_key, "safe_set_local_optimizer_state")
        if index is None:
            state.copy_(value.reshape(state.shape))
        else:
            _write(state, _fragment(wrapper, index, param), value, "safe_set_local_optimizer_state")


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite `param`'s optimizer state `optim_state_key` with the full `value` (given on every rank)."""
    wrapper, index = _owner(param, "safe_set_full_optimizer_state")
    if index is None:
        safe_set_local_optimizer_state(param, value, optim_state_key)
        return
    fragment = _fragment(wrapper, index, param)
    piece = value.reshape(-1)[fragment[0] : fragment[0] + fragment[2]] if fragment else value.new_empty(0)
    safe_set_local_optimizer_state(param, piece, optim_state_key)
