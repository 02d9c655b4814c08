"""FSDP's flat parameter and the module attributes that view it (FairScale's FlattenParamsWrapper role).

`FlatHolder` sits between an FSDP instance and the user's module (`_fsdp_wrapped_module`, holding the user's
module as `_fpw_module`, FairScale's names). With `flatten_parameters` it owns `flat_param_0`: the module's
parameters (those no nested instance owns, each shared one once) packed in order. The original parameters
are unregistered from their modules; before each forward their attributes become views of the flat
parameter (so gradients flow into it), and inside `summon_full_params` the original parameters are
registered again, holding the full values, so that names and objects are the unwrapped model's.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FlatHolder", "clean_name", "owned_registrations"]

FLAT_NAME = "flat_param_0"


def clean_name(name: str) -> str:
    """A parameter or buffer name with FSDP's wrapper levels taken out: the unwrapped model's name."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")


def owned_registrations(root: nn.Module, stop: type) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(module, attribute, parameter) for every parameter registered under `root`, not below a `stop`."""
    found = []

    def visit(module: nn.Module) -> None:
        for name, param in module._parameters.items():
            if param is not None:
                found.append((module, name, param))
        for child in module._modules.values():
            if child is not None and not isinstance(child, stop):
                visit(child)

    visit(root)
    return found


class FlatHolder(nn.Module):
    """FairScale's `_fsdp_wrapped_module`: the user's module (`_fpw_module`) and, flattened, its flat parameter."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._fpw_module = module
        self._registrations: list[tuple[nn.Module, str, int]] = []  # (module, attribute, original index)
        self._originals: list[nn.Parameter] = []
        self._shapes: list[torch.Size] = []
        self._offsets: list[int] = []
        self._flat: nn.Parameter | None = None
        self.leaves: list[nn.Parameter] = []  # not flattened: the original parameters, each sharded alone

    def forward(self, *args, **kwargs):
        return self._fpw_module(*args, **kwargs)

    def __getattr__(self, name: str):
        """The user's module's attributes and children, through the holder (FairScale's wrapper does it)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fpw_module":
                raise
            return getattr(self._fpw_module, name)

    def __getitem__(self, key):
        return self._fpw_module[key]

    def flatten(self, registrations, unique: list[nn.Parameter]) -> nn.Parameter:
        """Pack `unique` into the flat parameter and unregister them from their modules."""
        index = {id(p): i for i, p in enumerate(unique)}
        self._originals = unique
        self._shapes = [p.shape for p in unique]
        numels = [p.numel() for p in unique]
        self._offsets = [sum(numels[:i]) for i in range(len(unique))]
        requires_grad = any(p.requires_grad for p in unique)
        flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in unique]), requires_grad=requires_grad)
        self._registrations = [(module, name, index[id(p)]) for module, name, p in registrations]
        for module, name, _ in self._registrations:
            del module._parameters[name]
        for p in unique:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # the values live in the flat parameter
        self.register_parameter(FLAT_NAME, flat)
        object.__setattr__(self, "_flat", flat)  # held, not registered a second time
        return flat

    def point_at_views(self) -> None:
        """Before a forward: each original attribute becomes a view of the (gathered) flat parameter."""
        if self._flat is None:
            return
        views = [
            self._flat[offset : offset + shape.numel()].view(shape)
            for offset, shape in zip(self._offsets, self._shapes)
        ]
        for module, name, i in self._registrations:
            setattr(module, name, views[i])

    def show_originals(self, full_values: list[torch.Tensor], flattened: bool) -> None:
        """Inside summon_full_params: the original parameters, registered, holding `full_values`."""
        if not flattened:
            for param, value in zip(self.leaves, full_values):
                param.data = value
            return
        full = full_values[0] if full_values else None
        for param, offset, shape in zip(self._originals, self._offsets, self._shapes):
            param.data = full[offset : offset + shape.numel()].view(shape).clone()
        del self._parameters[FLAT_NAME]
        for module, name, i in self._registrations:
            module.__dict__.pop(name, None)
            module._parameters[name] = self._originals[i]

    def hide_originals(self, flattened: bool) -> list[torch.Tensor]:
        """Leaving summon_full_params: the full values as they are now (edits included)."""
        if not flattened:
            return [p.data for p in self.leaves]
        values = [torch.cat([p.data.reshape(-1) for p in self._originals])] if self._originals else []
        for module, name, _ in self._registrations:
            del module._parameters[name]
        for param in self._originals:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        for module, name, i in self._registrations:
            module.__dict__[name] = self._originals[i]  # unregistered; the next forward points it at a view
        self.register_parameter(FLAT_NAME, self._flat)
        return values
