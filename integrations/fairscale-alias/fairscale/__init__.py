"""`fairscale` as an alias of shardspeed's FairScale API (shardspeed-fairscale-alias).

Every `fairscale.<path>` module is made here from the table in shardspeed/compat/fairscale_paths.py: a
module exists for each prefix of a table key (`fairscale.optim`, `fairscale.optim.oss`) and its attributes
are what the table places under it (`fairscale.optim.oss.OSS` is `shardspeed.fairscale.oss.OSS`). A
FairScale name shardspeed does not offer imports as a stand-in that raises `NotOfferedError` naming it when
used; a name the table does not know is an AttributeError (an ImportError in `from ... import`). No
FairScale code is inside, and no module of shardspeed exists twice.

If the real FairScale is importable from another place on `sys.path`, importing this package raises
ImportError: which of the two code gets would depend on path order, so neither is picked silently.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types

from shardspeed.compat.alias_guard import refuse_real_package
from shardspeed.compat.fairscale_paths import FAIRSCALE_PATHS, FAIRSCALE_VERSION
from shardspeed.compat.not_offered import NotOffered, not_offered_class

ALIAS = "fairscale"
ALIAS_MARKER = "shardspeed-fairscale-alias"  # found in another copy of this file: not a conflict

try:
    __version__ = importlib.metadata.version(ALIAS)
except importlib.metadata.PackageNotFoundError:  # imported from a source tree without metadata
    __version__ = f"{FAIRSCALE_VERSION}+shardspeed"
__version_tuple__ = tuple(int(x) for x in __version__.split("+")[0].split("."))
__path__: list[str] = []  # submodules come only from the finder below

# every proper prefix of a table path is a module of the alias
_MODULES = {p.rsplit(".", i)[0] for p in FAIRSCALE_PATHS for i in range(1, p.count(".") + 1)}
_MODULES |= {p for p, entry in FAIRSCALE_PATHS.items() if isinstance(entry, NotOffered) and entry.module}


def _not_offered_ancestor(path: str) -> NotOffered | None:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        entry = FAIRSCALE_PATHS.get(".".join(parts[:cut]))
        if isinstance(entry, NotOffered) and entry.module:
            return entry
    return None


def _resolve(path: str):
    entry = FAIRSCALE_PATHS[path]
    if isinstance(entry, NotOffered):
        if entry.module:
            return importlib.import_module(f"{ALIAS}.{path}")
        return not_offered_class(path, entry.reason, ALIAS)
    module_name, attribute = entry.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def _attribute(path: str, name: str):
    """`fairscale.<path>.<name>` as the table places it; AttributeError where it places nothing."""
    key = f"{path}.{name}" if path else name
    if key in FAIRSCALE_PATHS:
        return _resolve(key)
    if key in _MODULES:
        return importlib.import_module(f"{ALIAS}.{key}")
    entry = _not_offered_ancestor(key)
    if entry is not None and not name.startswith("__"):
        return not_offered_class(key, entry.reason, ALIAS)
    raise AttributeError(f"module {ALIAS + ('.' + path if path else '')!r} has no attribute {name!r}")


class _AliasModule(types.ModuleType):
    """A FairScale module path: its names come from the table."""

    def __getattr__(self, name: str):
        value = _attribute(self.__name__[len(ALIAS) + 1 :], name)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        prefix = self.__name__[len(ALIAS) + 1 :] + "."
        names = {p[len(prefix) :].split(".")[0] for p in FAIRSCALE_PATHS if p.startswith(prefix)}
        return sorted(names | set(self.__dict__))


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _AliasModule(spec.name, f"FairScale's `{spec.name}` (shardspeed/compat/fairscale_paths.py)")
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Answers `fairscale.<path>` for every module path of the table (and everything under a module that
    is not offered)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(ALIAS + "."):
            return None
        relative = fullname[len(ALIAS) + 1 :]
        if relative not in _MODULES and _not_offered_ancestor(relative) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=True)


def __getattr__(name: str):
    value = _attribute("", name)
    globals()[name] = value
    return value


refuse_real_package(ALIAS, __file__, ALIAS_MARKER, "FairScale itself")
if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
