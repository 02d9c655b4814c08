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

from shardspeed.config.zero import ZeroConfig
from shardspeed.core.flat_params import _moved
from shardspeed.zero.offload_kinds import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "StateOffloader"]

_GRADS = {OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer}


class StateOffloader:
    """The engine's part that moves its state kinds between the device and the host: the state of the stage
    wrapper `optimizer` (None: the engine has none), whose home is `device`. `zero` is the
    `zero_optimization` block, whose offload settings decide what may move."""

    def __init__(self, optimizer, device: torch.device, zero: ZeroConfig):
        self.optimizer = optimizer
        self.device = device
        self.zero = zero
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
        self._move(self.offloaded, self.device, False, non_blocking)
        self.offloaded = set()
        if non_blocking and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def check_resident(self, what: str) -> None:
        """Refuse training while state is away (the engine calls this before forward/backward/step)."""
        if self.offloaded:
            kinds = ", ".join(sorted(k.value for k in self.offloaded))
            raise RuntimeError(
                f"engine.{what}: states are offloaded ({kinds}); call engine.reload_states() first"
            )

    # -- helpers -------------------------------------------------------------------------------------------

    def _kinds(self, include) -> set[OffloadStateTypeEnum]:
        if self.optimizer is None:
            raise ValueError("offload_states needs an optimizer (initialize() was given none)")
        param_offload = self.zero.offload_param
        if param_offload is not None and param_offload.device != "none":
            raise ValueError(
                "offload_states is not supported with zero_optimization.offload_param (parameters already live "
                f"on {param_offload.device!r})"
            )
        kinds = {OffloadStateTypeEnum(k) for k in (include if include is not None else OffloadStateTypeEnum)}
        on_host = self.zero.offload_optimizer
        if on_host is not None and on_host.device in ("cpu", "nvme"):  # optimizer offload: already there
            kinds -= {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
        return kinds

    def _move(self, kinds, device: torch.device, pin: bool, non_blocking: bool) -> None:
        for wrapper in _stage_wrappers(self.optimizer):
            if OffloadStateTypeEnum.optim_states in kinds:
                _move_optimizer_state(wrapper.optimizer, device, pin, non_blocking)
            if OffloadStateTypeEnum.hp_params in kinds:
                _move_masters(wrapper, device, pin, non_blocking)
            if OffloadStateTypeEnum.lp_params in kinds:
                _move_params(wrapper, device, pin, non_blocking)
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
    """fp32 masters of their own. A master that is a view (stage 0's are views of one flat per bucket) is
    replaced by a view of the moved flat and the optimizer re-keyed: re-pointing the old view in place
    would keep the old buffer alive through the view's base. A master that is a shard view of the
    parameters (fp32 training, stages 1-2) moves with the parameters (`_move_params`)."""
    if wrapper.zero_stage == 0:
        remap = {}
        for index, flat in enumerate(wrapper.master_flats):  # one per gradient bucket, in bucket order
            moved = _moved(flat, device, pin, non_blocking)
            wrapper.master_flats[index] = moved
            offset = 0
            for p in wrapper.reducer.buckets[index].params:
                fresh = moved[offset : offset + p.numel()].view_as(p)
                remap[wrapper.masters[p]], wrapper.masters[p] = fresh, fresh
                offset += p.numel()
        _rekey(wrapper.optimizer, remap)
        return
    for master in wrapper.masters:
        if master._base is None:  # in place: the optimizer's state is keyed by this tensor
            master.data = _moved(master.data, device, pin, non_blocking)


def _rekey(optimizer, remap: dict) -> None:
    """Replace tensors in the optimizer's groups and state by their new selves (`remap`: old -> new)."""
    if not remap:
        return
    for group in optimizer.param_groups:
        group["params"] = [remap.get(p, p) for p in group["params"]]
    for old, new in remap.items():
        if old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)


def _move_params(wrapper, device, pin, non_blocking) -> None:
    if wrapper.zero_stage == 0:
        for bucket in wrapper.reducer.buckets:
            for p in bucket.params:
                p.data = _moved(p.data, device, pin, non_blocking)
        return
    units = wrapper.coordinator.units if wrapper.coordinator is not None else wrapper.buckets
    for unit in units:
        unit.move_to(device, pin, non_blocking)
    if wrapper.zero_stage < 3:  # a master that is its bucket's shard view (fp32 training) follows the bucket
        remap = {}
        for index, bucket in enumerate(wrapper.buckets):
            master = wrapper.masters[index]
            if master._base is not None and master.device != bucket.device:
                remap[master] = wrapper.masters[index] = bucket.shard
        _rekey(wrapper.optimizer, remap)
