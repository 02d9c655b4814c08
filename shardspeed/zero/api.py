"""User-facing ZeRO helpers with DeepSpeed's names: GatheredParameters and the safe_get/set accessors.

Every ZeRO-managed parameter carries `_shardspeed_zero = (wrapper, bucket_index)` pointing at the optimizer
wrapper that owns its shard (see zero/optimizer.py). The accessors are collective over the data-parallel
group for stages 1-3: every rank must call them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.comm.collectives import all_gather_flat
from shardspeed.core import partitioned
from shardspeed.zero.stage3 import external_params_of


def _owner(param: nn.Parameter):
    return getattr(param, "_shardspeed_zero", None)


class GatheredParameters:
    """Context manager giving full stage-3 parameters inside the block (a no-op for other stages).

    Works on parameters of a ZeRO-3 engine and on parameters partitioned by `zero.Init` before any engine
    exists (HF Transformers initialises and loads weights that way). With `modifier_rank`, changes made on
    that rank are broadcast to all ranks and written back into the shards (and the fp32 master weights) on
    exit; without it, changes are discarded, as in DeepSpeed.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        del fwd_module  # accepted for DeepSpeed compatibility
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.params = params if enabled else []
        self.units = []
        if enabled:
            units = {
                id(u): u for u in (getattr(p, "_shardspeed_unit", None) for p in params) if u is not None
            }
            self.units = sorted(units.values(), key=lambda u: u.names[0])  # the same order on every rank
        # Partitioned by zero.Init, not yet owned by an engine: in the caller's order, the same on every rank.
        self.init_params = [p for p in params if partitioned.is_partitioned(p)] if enabled else []

    def __enter__(self):
        for unit in self.units:
            unit.hold()
        for param in self.init_params:
            partitioned.gather(param)
        missing = [p for p in self.params if hasattr(p, "ds_shape") and p.shape != p.ds_shape]
        if missing:  # a ZeRO-3 parameter no engine or zero.Init owns here: its empty data must not be read
            names = ", ".join(f"ds_id {p.ds_id} {tuple(p.ds_shape)}" for p in missing[:5])
            self.__exit__(None, None, None)
            raise RuntimeError(f"GatheredParameters could not gather {len(missing)} parameter(s): {names}")
        return self

    def __exit__(self, *exc):
        for param in self.init_params:
            partitioned.release(param, self.modifier_rank)
        for unit in self.units:
            if self.modifier_rank is not None:
                src = (
                    dist.get_global_rank(unit.group, self.modifier_rank) if unit.group else self.modifier_rank
                )
                dist.broadcast(unit.flat, src=src, group=unit.group)
                unit.shard.copy_(unit.flat[unit.rank * unit.shard_numel : (unit.rank + 1) * unit.shard_numel])
                if unit.on_modified is not None:
                    unit.on_modified()
            unit.let_go(keep_taken_views=True)
        return False


def _full_from_shards(wrapper, index: int, shard: torch.Tensor) -> torch.Tensor:
    bucket = wrapper.buckets[index]
    full = torch.empty(bucket.padded_numel, dtype=shard.dtype, device=shard.device)
    all_gather_flat(full, shard.contiguous(), group=wrapper.group)
    return full


def _param_slice(wrapper, index: int, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    bucket = wrapper.buckets[index]
    i = next(k for k, p in enumerate(bucket.params) if p is param)
    return full[bucket.offsets[i] : bucket.offsets[i] + bucket.numels[i]].view(bucket.shapes[i]).clone()


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master value of `param` (collective for ZeRO stages 1-3); None if not managed."""
    owner = _owner(param)
    if owner is None:
        return None
    wrapper, index = owner
    if index is None:  # stage 0: masters are full already
        return wrapper.masters.get(param, param.detach()).float().clone()
    with wrapper._resident_state([index]):  # NVMe offload: the master is read back for the duration
        master = wrapper.masters[index].clone()
    return _param_slice(wrapper, index, param, _full_from_shards(wrapper, index, master))


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite `param`'s fp32 master (and the module's copy) with the full `value` on every rank."""
    owner = _owner(param)
    if owner is None:
        return
    wrapper, index = owner
    if index is None:
        wrapper.masters.get(param, param.data).copy_(value)
        param.data.copy_(value)
        return
    bucket = wrapper.buckets[index]
    i = next(k for k, p in enumerate(bucket.params) if p is param)
    with wrapper._resident_state([index]):  # NVMe offload: written back to its file on exit
        for j, _, in_param, in_shard, length in bucket.fragments():
            if j == i:
                piece = value.reshape(-1)[in_param : in_param + length]
                wrapper.masters[index][in_shard : in_shard + length].copy_(piece)
                bucket.shard[in_shard : in_shard + length].copy_(piece)
    wrapper._publish_shards()


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The full averaged gradient of `param` after backward, as the step will use it (collective for
    stages 1-3)."""
    owner = _owner(param)
    if owner is None:
        return None
    wrapper, index = owner
    if index is None:
        grad = wrapper.gradient_of(param)
        return None if grad is None else grad.detach().float() * wrapper.gradient_scale
    shard = wrapper.gradient_shard(index).float() * wrapper.gradient_scale
    return _param_slice(wrapper, index, param, _full_from_shards(wrapper, index, shard))


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state `optim_state_key` (e.g. "exp_avg") of `param` (collective for stages 1-3)."""
    owner = _owner(param)
    if owner is None:
        return None
    wrapper, index = owner
    if index is None:
        state = wrapper.optimizer.state.get(wrapper.masters.get(param, param), {})
        return state[optim_state_key].clone() if optim_state_key in state else None
    state = wrapper.shard_state(index)
    if optim_state_key not in state:
        return None
    return _param_slice(wrapper, index, param, _full_from_shards(wrapper, index, state[optim_state_key]))


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that `module`'s forward uses `parameter` owned by another module (stage 3).

    shardspeed also discovers such uses by itself (parameter reads inside a forward gather the owner), so
    this only saves the first, synchronous gather.
    """
    owner = _owner(parameter)
    if owner is None or owner[0].zero_stage != 3:
        return
    wrapper, index = owner
    needs = wrapper.coordinator.needs.get(module)
    unit = wrapper.buckets[index]
    external_params_of(module)[id(parameter)] = parameter
    if needs is not None and unit not in needs:
        needs.append(unit)
    elif needs is None:
        wrapper.coordinator._hook(module, [unit])


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    owner = _owner(parameter)
    if owner is not None and owner[0].zero_stage == 3:
        needs = owner[0].coordinator.needs.get(module, [])
        unit = owner[0].buckets[owner[1]]
        if unit in needs:
            needs.remove(unit)
        external_params_of(module).pop(id(parameter), None)


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """Run generation/evaluation with every parameter gathered once (ZeRO-3) and the module hooks taken off
    (put back on exit, as DeepSpeed's); yields the module.

    Token-by-token generation would otherwise gather each layer once per token. Needs memory for the full
    model while inside. `model` is the engine (or anything with `.module` and `.optimizer`).
    """
    wrapper = getattr(model, "optimizer", None)
    module = getattr(model, "module", model)
    coordinator = getattr(wrapper, "coordinator", None)
    if coordinator is None:
        yield module
        return
    units = sorted(coordinator.units, key=lambda u: u.names[0])
    for unit in units:
        unit.hold()
    coordinator.paused = True
    # As DeepSpeed, the module hooks are taken off (the module runs as a plain one; `forward_hooks` is empty
    # inside) and put back after, which also drops the recorded gather order: the next step records anew.
    for handle in coordinator.hook_handles():
        handle.remove()
    coordinator.forget_removed_hooks()
    try:
        yield module
    finally:
        coordinator.paused = False
        if not coordinator.hook_handles():  # unless the caller put them back already
            coordinator.register_hooks(coordinator.root)
        for unit in units:
            unit.let_go()


@contextlib.contextmanager
def hooks_paused(model):
    """ZeRO-3's per-module gather/release hooks do nothing inside the block (nothing is gathered by it): the
    caller gathers what it reads itself (`GatheredParameters`), as the hybrid engine's tensor-parallel
    generation does layer group by layer group. A no-op below stage 3. `model` as in
    `unwrap_model_for_generation`."""
    coordinator = getattr(getattr(model, "optimizer", None), "coordinator", None)
    if coordinator is None:
        yield
        return
    was = coordinator.paused
    coordinator.paused = True
    try:
        yield
    finally:
        coordinator.paused = was
