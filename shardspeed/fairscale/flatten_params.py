"""FairScale's `FlattenParamsWrapper`: a module's parameters packed into a few flat parameters.

    module = FlattenParamsWrapper(model)                        # every parameter into `flat_param_0`
    module = FlattenParamsWrapper(model, param_list=[[a, b], [c]], flat_param_names=["x", "y"])

The wrapper registers the flat parameters (`flat_param_<name>`) and unregisters the parameters it packed from
their modules; before each forward each such attribute becomes a view of its flat parameter, so gradients
flow into the flat parameter and an optimizer over `wrapper.parameters()` steps a few large tensors. A
parameter shared by several modules is packed once and every attribute views the same slice.

The wrapper answers by the unwrapped model's names: `state_dict()` holds the original parameters (as views of
the flat ones) under the model's own keys, and `load_state_dict` takes such a state dict, or the flat one of
`flat_state_dict()`. `unflatten_params(flat_params=None)` registers the original parameters again while inside
(as views of the flat parameters, or of `flat_params` given from outside, which are not kept afterwards).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["FlattenParamsWrapper"]

_INNER = "_fpw_module."


class _Group:
    """One flat parameter: the packed parameters (unique, in model order), their shapes and offsets, and every
    (module, attribute, index) registration that pointed at one of them."""

    def __init__(self, name: str, params: list[nn.Parameter], registrations: list):
        self.name = name
        self.params = params
        self.shapes = [p.shape for p in params]
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(params))]
        self.registrations = registrations  # (module, attribute, index into params, dotted path)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]


class FlattenParamsWrapper(nn.Module):
    """FairScale's `FlattenParamsWrapper(module, param_list=None, flat_param_names=None)`.

    `param_list`: the parameters to pack (default: all of the module's), a list of them (one flat
    parameter) or a list of lists (one each; empty lists pack nothing). `flat_param_names`: one name per
    group, registered as `flat_param_<name>` (default "0", "1", ...).
    """

    def __init__(self, module: nn.Module, param_list=None, flat_param_names: list[str] | None = None):
        super().__init__()
        self._fpw_module = module
        sets = self._param_sets(module, param_list)
        # the unwrapped model's state-dict order, which state_dict() keeps
        self._key_order = {key: i for i, key in enumerate(module.state_dict(keep_vars=True))}
        if flat_param_names is None:
            flat_param_names = [str(i) for i in range(len(sets))]
        if len(flat_param_names) != len(sets) or len(set(flat_param_names)) != len(flat_param_names):
            raise ValueError(
                f"FlattenParamsWrapper(flat_param_names={flat_param_names}): give one distinct name per "
                f"parameter group ({len(sets)} groups)"
            )
        registered = [(path, m, n, p) for path, m in module.named_modules() for n, p in m._parameters.items()
                      if p is not None]  # fmt: skip
        self._groups: list[_Group] = []
        self.flat_params: list[nn.Parameter] = []
        for name, wanted in zip(flat_param_names, sets):
            order = {}  # unique parameters in the order the model registers them
            for _, _, _, p in registered:
                if p in wanted and p not in order:
                    order[p] = len(order)
            params = list(order)
            regs = [
                (m, n, order[p], f"{path}.{n}" if path else n) for path, m, n, p in registered if p in order
            ]
            group = _Group(f"flat_param_{name}", params, regs)
            flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]),
                                requires_grad=any(p.requires_grad for p in params))  # fmt: skip
            for m, n, _, _ in regs:
                del m._parameters[n]
            for p in params:  # the values live in the flat parameter now
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.register_parameter(group.name, flat)
            self._groups.append(group)
            self.flat_params.append(flat)
        self.flat_param_names = [g.name for g in self._groups]
        self.is_flattened = True
        self._flat_state_dict = False  # flat_state_dict() in progress: keys as registered
        self._point_at_views()
        self._register_state_dict_hook(_unflatten_state_dict)
        self._register_load_state_dict_pre_hook(_flatten_loaded_state_dict, with_module=True)

    @staticmethod
    def _param_sets(module: nn.Module, param_list) -> list[set]:
        if param_list is None:
            param_list = list(module.parameters())
        if len(param_list) and all(isinstance(p, nn.Parameter) for p in param_list):
            param_list = [param_list]
        sets = []
        for group in param_list:
            if not all(isinstance(p, nn.Parameter) for p in group):
                raise TypeError(
                    "FlattenParamsWrapper(param_list=...): a list of parameters, or a list of such lists"
                )
            if group:
                sets.append(set(group))
        mine = set(module.parameters())
        for group in sets:
            if not group <= mine:
                raise ValueError(
                    "FlattenParamsWrapper(param_list=...): a parameter is not one of the module's"
                )
        if sum(len(s) for s in sets) != len(set().union(*sets)):
            raise ValueError("FlattenParamsWrapper(param_list=...): a parameter is in two groups")
        return sets

    # -- FairScale's attributes --------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        return self._fpw_module

    @property
    def flat_param(self) -> nn.Parameter:
        if len(self.flat_params) != 1:
            raise RuntimeError(
                f"flat_param: this wrapper has {len(self.flat_params)} flat parameters; use flat_params"
            )
        return self.flat_params[0]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fpw_module":
                raise
            return getattr(self._fpw_module, name)

    def __getitem__(self, key):
        return self._fpw_module[key]

    # -- views -------------------------------------------------------------------------------------------------

    def _point_at_views(self) -> None:
        """Each packed attribute becomes a view of its flat parameter (made anew each forward: after `.to()`
        or a load, the flat parameter's storage may be another)."""
        for group, flat in zip(self._groups, self.flat_params):
            views = group.views(flat)
            for m, n, i, _ in group.registrations:
                setattr(m, n, views[i])

    def forward(self, *args, **kwargs):
        if self.is_flattened:
            self._point_at_views()
        return self._fpw_module(*args, **kwargs)

    @contextlib.contextmanager
    def unflatten_params(self, flat_params: list[torch.Tensor] | None = None):
        """Inside: the original parameters registered again, viewing the flat parameters (edits reach them)
        or `flat_params` (one tensor per flat parameter, not kept after the block)."""
        if not self.is_flattened:
            raise RuntimeError("FlattenParamsWrapper.unflatten_params: already unflattened (nested use)")
        backing = [f.data for f in self.flat_params] if flat_params is None else list(flat_params)
        if len(backing) != len(self.flat_params) or any(
            b.shape != f.shape for b, f in zip(backing, self.flat_params)
        ):
            raise ValueError(
                "FlattenParamsWrapper.unflatten_params: give one tensor per flat parameter, same shapes"
            )
        for group, data in zip(self._groups, backing):
            del self._parameters[group.name]
            for param, view in zip(group.params, group.views(data)):
                param.data = view
            for m, n, i, _ in group.registrations:
                m.__dict__.pop(n, None)
                m._parameters[n] = group.params[i]
        self.is_flattened = False
        try:
            yield self
        finally:
            for group, flat in zip(self._groups, self.flat_params):
                for m, n, _, _ in group.registrations:
                    del m._parameters[n]
                for param in group.params:
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                self.register_parameter(group.name, flat)
            self.is_flattened = True
            self._point_at_views()

    # -- state dicts -------------------------------------------------------------------------------------------

    def flat_state_dict(self, *args, **kwargs) -> dict:
        """The state dict as registered: the flat parameters, and the rest under `_fpw_module.`."""
        self._flat_state_dict = True
        try:
            return self.state_dict(*args, **kwargs)
        finally:
            self._flat_state_dict = False


def _unflatten_state_dict(wrapper: FlattenParamsWrapper, state: dict, prefix: str, _metadata) -> dict:
    """State dict hook: flat parameters become the original parameters, under the unwrapped model's keys."""
    if wrapper._flat_state_dict or not wrapper.is_flattened:
        if not wrapper._flat_state_dict:
            _strip_inner_prefix(state, prefix, wrapper._key_order)
        return state
    for group in wrapper._groups:
        flat = state.pop(prefix + group.name)
        views = group.views(flat)
        for _, _, i, path in group.registrations:
            state[prefix + _INNER + path] = views[i]
    _strip_inner_prefix(state, prefix, wrapper._key_order)
    return state


def _strip_inner_prefix(state: dict, prefix: str, order: dict | None = None) -> None:
    """Keys under `prefix` lose the wrapper's `_fpw_module.` level, in the unwrapped model's order."""
    inner = prefix + _INNER
    entries = [(k, state.pop(k)) for k in [k for k in state if k.startswith(prefix)]]
    renamed = [(prefix + k[len(inner) :] if k.startswith(inner) else k, v) for k, v in entries]
    if order:
        renamed.sort(key=lambda kv: order.get(kv[0][len(prefix) :], len(order)))
    for k, v in renamed:
        state[k] = v


def _flatten_loaded_state_dict(wrapper: FlattenParamsWrapper, state: dict, prefix: str, *_args) -> None:
    """Load pre-hook: a state dict under the unwrapped model's keys is packed into the flat parameters' keys
    (a flat one of `flat_state_dict()` passes as it is)."""
    if not wrapper.is_flattened:  # inside unflatten_params: the original parameters are registered
        for key in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + _INNER)]:
            state[prefix + _INNER + key[len(prefix) :]] = state.pop(key)
        return
    for group in wrapper._groups:
        if prefix + group.name in state:
            continue
        pieces: dict[int, torch.Tensor] = {}
        for _, _, i, path in group.registrations:
            key = prefix + path
            if key in state:
                pieces.setdefault(i, state.pop(key))
        if len(pieces) == len(group.params):
            state[prefix + group.name] = torch.cat([pieces[i].reshape(-1) for i in range(len(group.params))])
    flat_keys = {prefix + g.name for g in wrapper._groups}
    for key in [
        k for k in state if k.startswith(prefix) and k not in flat_keys and not k.startswith(prefix + _INNER)
    ]:
        state[prefix + _INNER + key[len(prefix) :]] = state.pop(key)
