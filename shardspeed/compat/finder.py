"""How the path table (paths.py) is applied: to imports (a meta-path finder) and to attribute access.

`import shardspeed` installs `CompatFinder` first on `sys.meta_path`. For a module name `shardspeed.<path>`:

1. `<path>` (or an ancestor) names another shardspeed module in the table (`runtime.pipe` ->
   `shardspeed.pipe`): the import answers with that module object itself, so no module exists twice.
2. `<path>` (or an ancestor) is a DeepSpeed module we do not offer: a stand-in module (not_offered.py).
3. A real module of that name exists: it is imported as usual, and then given a module `__getattr__`
   (see `attribute_of`) so that table names under it and its not yet imported submodules are attributes.
4. `<path>` only prefixes table entries (`runtime.zero.stage3`, whose one name lives in shardspeed.zero):
   a small virtual module whose attributes come from the table.

The `deepspeed` alias (integrations/deepspeed-alias) maps `deepspeed.X` to `shardspeed.X`, so both kinds of
user get the same paths from the same table. `attribute_of` is also what `shardspeed.__getattr__` calls.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

from shardspeed.compat.not_offered import NotOffered, not_offered_class, not_offered_module
from shardspeed.compat.paths import PATHS

__all__ = ["CompatFinder", "attribute_of", "install", "resolve"]

ROOT = "shardspeed"
_MISSING = object()

# DeepSpeed module paths that are another shardspeed module: "runtime.pipe" -> "shardspeed.pipe"
_MODULE_ALIASES = {
    path: t for path, t in PATHS.items() if isinstance(t, str) and ":" not in t and not path.endswith(".*")
}
# and the other way round, so that `shardspeed.pipe` answers `topology` from "runtime.pipe.topology"
_ALIASED_AS: dict[str, list[str]] = {}
for _path, _target in _MODULE_ALIASES.items():
    _ALIASED_AS.setdefault(_target, []).append(_path)
# "runtime.lr_schedules.*" -> the module whose public names extend `runtime.lr_schedules`
_EXTENSIONS = {path[:-2]: t for path, t in PATHS.items() if path.endswith(".*")}
# every proper prefix of a table path: a module even where shardspeed has no file of that name
_PREFIXES = {p.rsplit(".", i)[0] for p in PATHS for i in range(1, p.count(".") + 1)}  # "a.b.*" gives "a.b"
_STAND_INS: dict[str, type] = {}


def _relative(fullname: str) -> str:
    return "" if fullname == ROOT else fullname[len(ROOT) + 1 :]


def _absolute(path: str) -> str:
    return f"{ROOT}.{path}" if path else ROOT


def _ancestor_entry(path: str):
    """The table entry for `path` or its nearest listed ancestor, with the rest of the path."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        entry = PATHS.get(".".join(parts[:cut]))
        if entry is not None:
            return entry, ".".join(parts[cut:])
    return None, ""


def resolve(path: str):
    """The object at DeepSpeed path `path` (relative to `deepspeed`) as the table places it."""
    entry = PATHS[path]
    if isinstance(entry, NotOffered):
        if entry.module:
            return importlib.import_module(_absolute(path))
        if path not in _STAND_INS:
            _STAND_INS[path] = not_offered_class(path, entry.reason)
        return _STAND_INS[path]
    if ":" not in entry:
        return importlib.import_module(_absolute(path))
    module_name, attribute = entry.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def _listed(path: str):
    """What the table places at `path` (a module where table paths lie below it), or None where it lists
    nothing there."""
    if path in PATHS:
        return resolve(path)
    return importlib.import_module(_absolute(path)) if path in _PREFIXES else None


def _deepspeed_paths(fullname: str) -> list[str]:
    """The DeepSpeed paths a shardspeed module answers for: its own, and those of table aliases of it or of
    a package above it (`shardspeed.pipe.schedule` is also `runtime.pipe.schedule`)."""
    paths = [_relative(fullname)]
    parts = fullname.split(".")
    for cut in range(len(parts), 0, -1):
        rest = ".".join(parts[cut:])
        for alias in _ALIASED_AS.get(".".join(parts[:cut]), []):
            paths.append(f"{alias}.{rest}" if rest else alias)
    return paths


def attribute_of(module: types.ModuleType, name: str):
    """`module.<name>` from the table, or a submodule not imported yet; else AttributeError."""
    dunder = name.startswith("__")  # probed by tools (`__file__`, `__wrapped__`): only listed ones resolve
    for path in _deepspeed_paths(module.__name__):
        key = f"{path}.{name}" if path else name
        value = _MISSING
        if key in PATHS:
            value = resolve(key)
        elif path in _EXTENSIONS and not name.startswith("_"):
            value = getattr(importlib.import_module(_EXTENSIONS[path]), name, _MISSING)
        elif key in _PREFIXES:  # a module only the table knows (`ops.op_builder.builder`)
            value = importlib.import_module(_absolute(key))
        if value is not _MISSING:
            setattr(module, name, value)  # later look-ups skip this function
            return value
    if "__path__" in vars(module) and not dunder:
        child = f"{module.__name__}.{name}"
        try:
            return importlib.import_module(child)
        except ModuleNotFoundError as error:
            if error.name != child:
                raise  # a real import error inside that module: show it
    raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")


def _with_table_attributes(module: types.ModuleType) -> None:
    """Give `module` a module-level `__getattr__` falling back to the table (after its own, if any)."""
    own = module.__dict__.get("__getattr__")
    if getattr(own, "_compat_hook", False):
        return

    def __getattr__(name: str):
        if own is not None:
            try:
                return own(name)
            except AttributeError:
                pass
        return attribute_of(module, name)

    __getattr__._compat_hook = True
    module.__getattr__ = __getattr__


class _VirtualModule(types.ModuleType):
    """A DeepSpeed module path with no file here: its names come from the table."""

    def __getattr__(self, name: str):
        return attribute_of(self, name)

    def __dir__(self) -> list[str]:
        prefix = _relative(self.__name__) + "."
        names = {p[len(prefix) :].split(".")[0] for p in PATHS if p.startswith(prefix)}
        return sorted(names | set(self.__dict__))


class _ExistingModuleLoader(importlib.abc.Loader):
    """Answers an import with a module object that already exists (under its own name)."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.original_spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.original_spec  # importlib set the alias's spec; keep the module's own

    def get_code(self, fullname):
        """`python -m shardspeed.<DeepSpeed path>` (runpy): the module's own code, run as `__main__`."""
        return self.original_spec.loader.get_code(self.original_spec.name)


class _NewModuleLoader(importlib.abc.Loader):
    def __init__(self, factory) -> None:
        self.factory = factory

    def create_module(self, spec):
        return self.factory(spec.name)

    def exec_module(self, module) -> None:
        pass


class _TableAttributesLoader(importlib.abc.Loader):
    """Runs the real loader, then adds the table's fallback `__getattr__` to the module."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _with_table_attributes(module)
        if not hasattr(module, "__path__") and _relative(module.__name__) in _PREFIXES:
            # DeepSpeed has a package where shardspeed has one file (`ops.adam`, whose `cpu_adam` and
            # `fused_adam` are this module): a search path makes its table children importable
            module.__path__ = []
        module.__loader__ = self.inner  # tools (inspect, linecache, runpy) talk to the real loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # get_code, get_source, get_resource_reader, ...


def _import_existing(name: str):
    """The module `name`, or None where no such module exists (a table path below an aliased module that
    only the table knows, such as `ops.op_builder.builder`)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise  # a real import error inside that module: show it
        return None


class CompatFinder(importlib.abc.MetaPathFinder):
    """Finds `shardspeed.<DeepSpeed path>` modules as the table says (see the module docstring)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(ROOT + "."):
            return None
        relative = _relative(fullname)
        entry, rest = _ancestor_entry(relative)
        if isinstance(entry, NotOffered) and entry.module:
            return self._spec(
                fullname, _NewModuleLoader(lambda n: not_offered_module(n, relative, entry.reason, _listed))
            )
        target = entry + (f".{rest}" if rest else "") if isinstance(entry, str) and ":" not in entry else None
        if target is not None and target != fullname:
            module = _import_existing(target)
            if module is not None:
                return self._spec(fullname, _ExistingModuleLoader(module), hasattr(module, "__path__"))
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _TableAttributesLoader(spec.loader)
            return spec
        if relative in _PREFIXES:
            return self._spec(fullname, _NewModuleLoader(self._virtual))
        return None

    @staticmethod
    def _virtual(name: str) -> types.ModuleType:
        module = _VirtualModule(
            name, f"DeepSpeed's `deepspeed.{_relative(name)}` path (shardspeed/compat/paths.py)"
        )
        module.__path__ = []
        return module

    @staticmethod
    def _spec(fullname: str, loader, is_package: bool = True):
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=is_package)


def install() -> None:
    """Put the finder first on sys.meta_path (once); `shardspeed/__init__.py` calls this before any import."""
    if not any(isinstance(finder, CompatFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, CompatFinder())
