"""`set_z3_leaf_modules`: mark modules whose parameters ZeRO-3 gathers together, as DeepSpeed does.

DeepSpeed gathers a "leaf" module's whole subtree at once instead of hooking each submodule, for modules
whose forward touches parameters in a data-dependent order (mixture-of-experts blocks: tokens reach only
some experts, so per-expert gathers would differ between ranks). shardspeed's stage 3 makes every marked
module (`_z3_leaf`) one parameter unit, whatever its size (zero/param_units.py `plan_units`).
`apply_zero_leaf_module_config` marks what the config's `zero_optimization.leaf_module` names; Accelerate calls
`set_z3_leaf_modules` itself for MoE models.
"""

from __future__ import annotations

from shardspeed.utils.logging import logger

__all__ = [
    "apply_zero_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
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


def set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True) -> list:
    """Mark every module of the given classes (or class names) as a ZeRO-3 leaf; returns those modules."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True) -> list:
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model, module_names, flag: bool = True, raise_if_not_found: bool = True):
    """Mark the modules named (as in `model.named_modules()`); returns (modules marked, names not found)."""
    by_name = dict(model.named_modules())
    missing = [name for name in module_names if name not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in the model")
    marked = [by_name[name] for name in module_names if name in by_name]
    for module in marked:
        module._z3_leaf = flag
    return marked, missing


def set_z3_leaf_modules_by_suffix(
    model, module_name_suffixes, flag: bool = True, raise_if_not_found: bool = True
):
    """Mark every module whose name ends with one of the suffixes; returns (modules marked, suffixes unmatched)."""
    named = list(model.named_modules())
    marked: dict[int, object] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [module for name, module in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            module._z3_leaf = flag
            marked.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_suffix: no module name ends with {missing}")
    return list(marked.values()), missing


def apply_zero_leaf_module_config(model, config) -> list:
    """Mark the modules `zero_optimization.leaf_module` selects (classes by name or ``package.Class``, module
    names, module-name suffixes). A selector the user wrote that matches nothing is logged."""
    from shardspeed.config.zero import DEFAULT_LEAF_MODULE_CLASSES

    marked = {id(m): m for m in _mark(model, config.classes, True, raise_if_not_found=False)}
    by_name, missing = set_z3_leaf_modules_by_name(model, config.names, raise_if_not_found=False)
    by_suffix, unmatched = set_z3_leaf_modules_by_suffix(
        model, config.name_suffixes, raise_if_not_found=False
    )
    for module in by_name + by_suffix:
        marked[id(module)] = module
    if missing or unmatched:
        logger.warning(f"zero_optimization.leaf_module: no module named {missing + unmatched} in the model")
    custom_classes = list(config.classes) != list(DEFAULT_LEAF_MODULE_CLASSES)
    if custom_classes and not any(_matches(m, (), set(config.classes)) for m in marked.values()):
        logger.warning(f"zero_optimization.leaf_module.classes: no module of {config.classes} in the model")
    return list(marked.values())


def set_z3_leaf_module(model, flag: bool) -> None:
    """Mark (or unmark) this one module as a ZeRO-3 leaf."""
    model._z3_leaf = flag


def z3_leaf_module(model) -> bool:
    return getattr(model, "_z3_leaf", False)


def get_z3_leaf_modules(model) -> list:
    return [m for m in model.modules() if z3_leaf_module(m)]
