"""`engine.offload_states()` / `reload_states()`: park the engine's state on the host between phases.

RLHF trainers alternate a training engine with generation: between training phases they move the
optimizer's state, the fp32 masters, the parameters and the gradient buffers to host memory and back
(DeepSpeed 0.19's API, with its enums from `offload_config.py`). Each kind moves as whole flat buffers
(buckets, units, masters), and every view into them (module parameters, `.grad`, masters that are shard
views) is re-pointed, so after `reload_states()` training continues bit for bit. Forward, backward and
step are not allowed in between.

Under optimizer offload the optimizer state and masters already live on the host and are left there, as
DeepSpeed does; parameter offload has homes of its own and is refused, as DeepSpeed does. Only the host
("cpu") is a destination: NVMe is refused. On a machine without an accelerator everything already is on
the host and nothing moves.
"""

from __future__ import annotations

import torch

from shardspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from shardspeed.zero.flat_params import _moved

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "StateOffloader"]

_GRADS = {OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer}


class StateOffloader:
    """The engine's part that moves its state kinds between the device and the host."""

    def __init__(self, engine):
        self.engine = engine
        self.offloaded: set[OffloadStateTypeEnum] = set()

    def offload(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                non_blocking: bool = False) -> None:  # fmt: skip
        kinds = self._kinds(include)
        device = OffloadDeviceEnum(device)
        if device == OffloadDeviceEnum.none:
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("offload_states(device='nvme'): only the host ('cpu') is supported")
        self._move(kinds, torch.device("cpu"), pin_memory, non_blocking)
        self.offloaded |= kinds

    def reload(self, non_blocking: bool = False) -> None:
        if not self.offloaded:
            return
        self._move(self.offloaded, self.engine.device, False, non_blocking)
        self.offloaded = set()
        if non_blocking and self.engine.device.type == "cuda":
            torch.cuda.current_stream(self.engine.device).synchronize()

    def check_resident(self, what: str) -> None:
        """Refuse training while state is away (the engine calls this before forward/backward/step)."""
        if self.offloaded:
            kinds = ", ".join(sorted(k.value for k in self.offloaded))
            raise RuntimeError(
                f"engine.{what}: states are offloaded ({kinds}); call engine.reload_states() first"
            )

    # -- helpers -------------------------------------------------------------------------------------------

    def _kinds(self, include) -> set[OffloadStateTypeEnum]:
        engine = self.engine
        if engine.optimizer is None:
            raise ValueError("offload_states needs an optimizer (initialize() was given none)")
        param_offload = engine.zero_offload_param()
        if param_offload is not None and param_offload.device != "none":
            raise ValueError(
                "offload_states is not supported with zero_optimization.offload_param (parameters already live "
                f"on {param_offload.device!r})"
            )
        kinds = {OffloadStateTypeEnum(k) for k in (include if include is not None else OffloadStateTypeEnum)}
        if engine.zero_use_cpu_optimizer():  # already on the host
            kinds -= {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
        return kinds

    def _move(self, kinds, device: torch.device, pin: bool, non_blocking: bool) -> None:
        for wrapper in _stage_wrappers(self.engine.optimizer):
            if OffloadStateTypeEnum.optim_states in kinds:
                _move_optimizer_state(wrapper.optimizer, device, pin, non_blocking)
            if OffloadStateTypeEnum.hp_params in kinds:
                _move_masters(wrapper, device, pin, non_blocking)
            if OffloadStateTypeEnum.lp_params in kinds:
                _move_params(self.engine, wrapper, device, pin, non_blocking)
            if kinds & _GRADS:
                grads = wrapper.reducer if wrapper.zero_stage == 0 else wrapper.grads
                grads.move_to(device, pin, non_blocking)


def _stage_wrappers(optimizer) -> list:
    domains = getattr(optimizer, "domains", None)
    return [d.wrapper for d in domains] if domains is not None else [optimizer]


def _move_optimizer_state(optimizer, device, pin, non_blocking) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # Adam's `step` stays where torch keeps it
                state[key] = _moved(value, device, pin, non_blocking)


def _move_masters(wrapper, device, pin, non_blocking) -> None:
    """fp32 masters that are tensors of their own (a master that is a view of the parameters' shard, in fp32
    training, moves with the parameters). Each keeps its identity: the optimizer's state is keyed by it."""
    if wrapper.zero_stage == 0:
        for index, flat in enumerate(wrapper.master_flats):
            moved = _moved(flat, device, pin, non_blocking)
            wrapper.master_flats[index] = moved
            _repoint_views(wrapper.masters, flat, moved)
        return
    for master in wrapper.masters:
        if master._base is None:
            master.data = _moved(master.data, device, pin, non_blocking)


def _repoint_views(views: dict, old: torch.Tensor, new: torch.Tensor) -> None:
    """Make every tensor in `views` that viewed `old` view the same elements of `new`."""
    for view in views.values():
        if view._base is old:
            offset = view.storage_offset() - old.storage_offset()
            view.data = new[offset : offset + view.numel()].view(view.shape)


def _move_params(engine, wrapper, device, pin, non_blocking) -> None:
    if wrapper.zero_stage == 0:
        for bucket in wrapper.reducer.buckets:
            for p in bucket.params:
                p.data = _moved(p.data, device, pin, non_blocking)
        return
    units = wrapper.coordinator.units if wrapper.coordinator is not None else wrapper.buckets
    for unit in units:
        unit.move_to(device, pin, non_blocking)
    if wrapper.zero_stage < 3 and not wrapper.plan.mixed:  # fp32: each master is its bucket's shard view
        for index, bucket in enumerate(wrapper.buckets):
            wrapper.masters[index].data = bucket.shard
