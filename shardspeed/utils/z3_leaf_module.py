"""`set_z3_leaf_modules`: mark modules whose parameters ZeRO-3 gathers together, as DeepSpeed does.

DeepSpeed gathers a "leaf" module's whole subtree at once instead of hooking each submodule, for modules
whose forward touches parameters in a data-dependent order (mixture-of-experts blocks: tokens reach only
some experts, so per-expert gathers would differ between ranks). shardspeed's stage 3 makes every marked
module (`_z3_leaf`) one parameter unit, whatever its size (zero/param_units.py `plan_units`).
`apply_leaf_module_config` marks what the config's `zero_optimization.leaf_module` names; Accelerate calls
`set_z3_leaf_modules` itself for MoE models.
"""

from __future__ import annotations

from shardspeed.utils.logging import logger

__all__ = [
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]


def _full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module, types: tuple, names: set) -> bool:
    cls = type(module)
    return isinstance(module, types) or cls.__name__ in names or _full_name(cls) in names


def _mark(model, leaf_module_classes, flag: bool, raise_if_not_found: bool = True) -> list:
    classes = tuple(leaf_module_classes)
    names = {c for c in classes if isinstance(c, str)}
    types = tuple(c for c in classes if isinstance(c, type))
    if len(names) + len(types) != len(classes):
        raise ValueError(
            f"leaf_module_classes: expected module classes or class names, got {list(leaf_module_classes)!r}"
        )
    marked = []
    for module in model.modules():
        if _matches(module, types, names):
            module._z3_leaf = flag
            marked.append(module)
    if not marked and raise_if_not_found:
        raise ValueError(f"no module of the classes {list(leaf_module_classes)!r} is in the model")
    return marked


def apply_leaf_module_config(model, config) -> list:
    """Mark the modules `zero_optimization.leaf_module` selects (classes by name or ``package.Class``, module
    names, module-name suffixes). A selector the user wrote that matches nothing is logged."""
    from shardspeed.config.zero import DEFAULT_LEAF_MODULE_CLASSES

    marked = {id(m): m for m in _mark(model, config.classes, True, raise_if_not_found=False)}
    named = dict(model.named_modules())
    missing = [name for name in config.names if name not in named]
    for name in config.names:
        if name in named:
            named[name]._z3_leaf = True
            marked[id(named[name])] = named[name]
    unmatched = []
    for suffix in config.name_suffixes:
        hits = [m for name, m in named.items() if name.endswith(suffix)]
        unmatched += [] if hits else [suffix]
        for m in hits:
            m._z3_leaf = True
            marked[id(m)] = m
    if missing or unmatched:
        logger.warning(f"zero_optimization.leaf_module: no module named {missing + unmatched} in the model")
    custom_classes = list(config.classes) != list(DEFAULT_LEAF_MODULE_CLASSES)
    if custom_classes and not any(_matches(m, (), set(config.classes)) for m in marked.values()):
        logger.warning(f"zero_optimization.leaf_module.classes: no module of {config.classes} in the model")
    return list(marked.values())


def set_z3_leaf_modules(model, leaf_module_classes) -> list:
    """Mark every module of the given classes (or class names) as a ZeRO-3 leaf; returns those modules."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model, leaf_module_classes) -> list:
    return _mark(model, leaf_module_classes, False)


def z3_leaf_module(model) -> bool:
    return getattr(model, "_z3_leaf", False)


def get_z3_leaf_modules(model) -> list:
    return [m for m in model.modules() if z3_leaf_module(m)]
