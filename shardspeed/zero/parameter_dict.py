"""`module._parameters` under ZeRO stage 3: a dict that gathers a partitioned parameter read inside a forward.

Modules may read a parameter without calling the module that owns it (nn.MultiheadAttention reads
`out_proj.weight`; a head reads the tied embedding weight). Under stage 3 such a parameter is an empty tensor
unless its unit is gathered, so the stage 3 coordinator (stage3.py) replaces each module's `_parameters` with
a `ZeROOrderedDict` bound to it: reading a managed parameter while a hooked forward runs gathers its unit for
the innermost running module (`Stage3Coordinator.on_parameter_access`). Reading it outside a forward, or
reading a parameter no unit manages, returns it as it is. A model with MoE layers has one coordinator per
reduction domain over the same modules: a dict is bound to each, and each gathers only its own units.

Modules attached after `initialize` (`engine.module.head = nn.Linear(...)`) have torch's plain dict: at the
start of each forward the coordinator converts every module of the model (`ensure_zero_ordered_dict`), so a
late module that reads a partitioned parameter gets it gathered too. DeepSpeed's names and behaviour
(`deepspeed.runtime.zero.parameter_offload`): the first container a module had is kept as
`module._original_parameters`, and converting twice changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["ZeROOrderedDict", "ensure_zero_ordered_dict"]


class ZeROOrderedDict(OrderedDict):
    """The parameters of `parent_module`; bound to coordinators, a read inside a forward gathers the
    parameter's unit first. Unbound (built directly, as DeepSpeed code does) it is a plain ordered dict
    until a coordinator adopts the module."""

    def __init__(self, parent_module, *args, coordinator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self.coordinators = [] if coordinator is None else [coordinator]

    def __reduce__(self):
        # pickled (deepcopy of a module) without the coordinator: a copy is not part of the running model
        return type(self), (self._parent_module,), None, None, iter(self.items())

    def __getitem__(self, name: str):
        param = super().__getitem__(name)
        if param is not None:
            for coordinator in self.coordinators:
                if coordinator.stack:  # inside a forward this coordinator hooks
                    coordinator.on_parameter_access(param)
        return param


def ensure_zero_ordered_dict(module, coordinator=None) -> None:
    """Make `module._parameters` a `ZeROOrderedDict` (bound to `coordinator` when one is given); a module
    whose container is one already keeps it (bound to `coordinator` too), and one without a dict of
    parameters (none, or not a dict) is left alone. The first container is kept as
    `module._original_parameters`, for code that puts it back."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict):
        if coordinator is not None and coordinator not in params.coordinators:
            params.coordinators.append(coordinator)
        return
    if not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = ZeROOrderedDict(module, params.items(), coordinator=coordinator)
