"""`engine.optimizer.parameter_offload`: DeepSpeed's ZeRO-3 hook manager, as RLHF frameworks reach into it.

DeepSpeed's stage-3 optimizer keeps its module hooks in a `DeepSpeedZeRoOffload` (`.parameter_offload`; an
engine without an optimizer has one as `engine.optimizer` itself). TRL's `unwrap_model_for_generation`
gathers every parameter, then takes the hooks off so generation runs on plain modules, then puts them back:

    for hook in offload.forward_hooks + offload.backward_hooks: hook.remove()
    offload.forward_hooks = offload.backward_hooks = []
    ...generate...
    offload.param_coordinator._invalidate_trace(); offload._register_deepspeed_module(offload.module)

Here the same names act on the stage-3 coordinator (stage3.py) with the same meaning:
- `module`: the module the hooks are on (the engine's module);
- `forward_hooks`: the handles of the module hooks that gather and release parameter units. shardspeed's
  forward hook also registers the backward gathers (on the forward's outputs), so there are no separate
  module hooks for backward and `backward_hooks` is always empty: removing the forward hooks removes both,
  as removing both lists does in DeepSpeed;
- assigning `[]` to either list forgets removed handles; assigning anything else cannot mean anything here
  (hooks are made by the coordinator, not adopted) and is refused, as is forgetting hooks still registered;
- `_register_deepspeed_module(module)` (DeepSpeed < 0.16.4: `_register_hooks_recursively`) puts the hooks
  of `module`'s subtree back, refusing modules whose hooks are still on (they would gather twice);
- `param_coordinator.is_invalid_trace()` / `_invalidate_trace()`: whether a gather order is recorded, and
  forgetting it (the prefetch order is re-recorded over the next step).
"""

from __future__ import annotations

from torch import nn

__all__ = ["ParameterOffload"]


class ParameterOffload:
    """DeepSpeed's `DeepSpeedZeRoOffload` surface over one ZeRO-3 `Stage3Coordinator`."""

    def __init__(self, coordinator) -> None:
        self._coordinator = coordinator
        self.param_coordinator = _Trace(coordinator)

    @property
    def module(self) -> nn.Module:
        return self._coordinator.root

    @property
    def forward_hooks(self) -> list:
        return self._coordinator.hook_handles()

    @forward_hooks.setter
    def forward_hooks(self, value) -> None:
        _refuse_adopting("forward_hooks", value)
        self._coordinator.forget_removed_hooks()

    @property
    def backward_hooks(self) -> list:
        return []  # the forward hook registers the backward gathers: nothing separate to remove

    @backward_hooks.setter
    def backward_hooks(self, value) -> None:
        _refuse_adopting("backward_hooks", value)

    def _register_deepspeed_module(self, module: nn.Module, count=None) -> None:
        del count  # DeepSpeed numbers modules through this argument; units carry their own order here
        self._coordinator.register_hooks(module)

    _register_hooks_recursively = _register_deepspeed_module  # its name before DeepSpeed 0.16.4

    def empty_partition_cache(self) -> None:
        self._coordinator.release_all()


class _Trace:
    """DeepSpeed's `PartitionedParameterCoordinator` as far as TRL reads it: the recorded gather order."""

    def __init__(self, coordinator) -> None:
        self._coordinator = coordinator

    def is_invalid_trace(self) -> bool:
        return not self._coordinator.order_is_recorded()

    def _invalidate_trace(self) -> None:
        self._coordinator.invalidate_order()


def _refuse_adopting(name: str, value) -> None:
    if not isinstance(value, list) or value:
        raise ValueError(
            f"parameter_offload.{name} = {value!r}: only [] (after removing the hooks) can be assigned; "
            "shardspeed makes its ZeRO-3 hooks itself. Put them back with _register_deepspeed_module(module)"
        )
