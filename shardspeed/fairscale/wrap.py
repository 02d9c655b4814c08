"""FairScale's nested wrapping: `enable_wrap`, `wrap`, `auto_wrap` and its policies.

    with enable_wrap(wrapper_cls=FullyShardedDataParallel, flatten_parameters=True):
        layer = wrap(nn.Linear(8, 8))                        # wrapped with the context's arguments
        model = auto_wrap(model, auto_wrap_policy=...)       # children wrapped where the policy says so

Outside an `enable_wrap` context `wrap` and `auto_wrap` return the module unchanged, as in FairScale (so code
can be written once for wrapped and unwrapped runs). A policy is called as
`policy(module, recurse, unwrapped_params, module_is_root)`: with `recurse` True it says whether to look
inside the module, with False whether to wrap it, given the parameters not yet wrapped below it.
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap", "wrap"]


class _WrapContext:
    """The innermost `enable_wrap`'s wrapper class, its arguments and its policy (None outside one)."""

    active: dict | None = None


def default_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool,
                             min_num_params: int = int(1e8), force_leaf_modules=None, exclude_wrap_modules=None,
                             skip_params_check_for_root: bool = False) -> bool:  # fmt: skip
    """Wrap a module holding at least `min_num_params` parameters not yet wrapped; never look inside
    `force_leaf_modules` (default: MultiheadAttention) nor wrap `exclude_wrap_modules` (default:
    ModuleList, ModuleDict)."""
    leaves = default_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    excluded = (
        default_auto_wrap_policy.EXCLUDE_WRAP_MODULES
        if exclude_wrap_modules is None
        else exclude_wrap_modules
    )
    large = unwrapped_params >= min_num_params
    if recurse:
        return large and not isinstance(module, tuple(leaves))
    return ((module_is_root and skip_params_check_for_root) or large) and not isinstance(
        module, tuple(excluded)
    )


default_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


def config_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool,
                            module_blocklist=None) -> bool:  # fmt: skip
    """Wrap every module that has a `wrapper_config` attribute (and look inside every other one)."""
    if recurse:
        return True
    blocked = tuple(module_blocklist or ())
    return hasattr(module, "wrapper_config") and not isinstance(module, blocked)


@contextlib.contextmanager
def enable_wrap(auto_wrap_policy=None, **wrapper_kwargs):
    """A context in which `wrap` and `auto_wrap` wrap with `wrapper_cls` (a keyword argument) and the other
    keyword arguments. Contexts do not nest."""
    if _WrapContext.active is not None:
        raise RuntimeError("enable_wrap contexts do not nest (FairScale allows one at a time as well)")
    if "wrapper_cls" not in wrapper_kwargs:
        raise ValueError("enable_wrap(wrapper_cls=...) is required: the class `wrap` applies")
    kwargs = dict(wrapper_kwargs)
    _WrapContext.active = {"cls": kwargs.pop("wrapper_cls"), "kwargs": kwargs, "policy": auto_wrap_policy}
    try:
        yield
    finally:
        _WrapContext.active = None


def wrap(module: nn.Module, **wrap_overrides) -> nn.Module:
    """`module` wrapped with the enable_wrap context's class and arguments (`wrap_overrides` win); unchanged
    outside a context. A module's own `wrapper_config` dict adds arguments too."""
    context = _WrapContext.active
    if context is None:
        return module
    kwargs = {**context["kwargs"], **getattr(module, "wrapper_config", {}), **wrap_overrides}
    return context["cls"](module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy=None, **kwargs) -> nn.Module:
    """Wrap `module`'s children recursively where the policy (this argument, else the context's, else
    `default_auto_wrap_policy`) says so; the root itself is wrapped only if the policy says so for it."""
    context = _WrapContext.active
    if context is None:
        return module
    policy = auto_wrap_policy or context["policy"] or default_auto_wrap_policy
    wrapped, _ = _recursive_wrap(module, policy, module_is_root=True, **kwargs)
    return wrapped


def _recursive_wrap(module: nn.Module, policy, module_is_root: bool, **kwargs) -> tuple[nn.Module, int]:
    """(the module, wrapped where the policy says, and the number of its parameters left unwrapped)."""
    wrapper = _WrapContext.active["cls"]
    if isinstance(module, wrapper):
        return module, 0
    unwrapped = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, unwrapped_params=unwrapped, module_is_root=module_is_root):
        return module, unwrapped
    wrapped_below = 0
    for name, child in list(module.named_children()):
        size = sum(p.numel() for p in child.parameters())  # before wrapping hides them in a flat parameter
        new, left = _recursive_wrap(child, policy, module_is_root=False, **kwargs)
        setattr(module, name, new)
        wrapped_below += size - left
    remaining = unwrapped - wrapped_below
    if policy(module=module, recurse=False, unwrapped_params=remaining, module_is_root=module_is_root):
        return wrap(module, **kwargs), 0
    return module, remaining
