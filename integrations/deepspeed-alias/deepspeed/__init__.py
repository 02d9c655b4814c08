"""`deepspeed` as an alias of shardspeed, for libraries that import DeepSpeed by name.

Hugging Face Transformers, Accelerate and Lightning detect DeepSpeed with `importlib.util.find_spec("deepspeed")`
and the installed distribution's metadata, then import its modules (`deepspeed.zero`, `deepspeed.runtime.engine`,
...). This package answers those imports with shardspeed's own modules: a meta-path finder maps every
`deepspeed.X` to the module object `shardspeed.X`, so `deepspeed.zero is shardspeed.zero` and no module
exists twice (a second copy would hold its own globals, e.g. a second process-group registry). Top-level
names (`deepspeed.initialize`, `deepspeed.DeepSpeedEngine`, ...) are shardspeed's; `deepspeed.__version__`
is this distribution's version, which is what the integrations' version checks read.

If the real DeepSpeed is importable from another place on `sys.path`, importing this package raises
ImportError: which of the two a library gets would depend on path order, so neither is picked silently.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys

import shardspeed
from shardspeed.compat.alias_guard import refuse_real_package

ALIAS = "deepspeed"
ALIAS_MARKER = "shardspeed-deepspeed-alias"  # found in another copy of this file: not a conflict
TARGET = "shardspeed"

try:
    __version__ = importlib.metadata.version(ALIAS)
except importlib.metadata.PackageNotFoundError:  # imported from a source tree without metadata
    __version__ = "0.19.8+shardspeed"
version = __version__
__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in __version__.split("+")[0].split(".")[:3]
)
__git_hash__ = shardspeed.__git_hash__
__git_branch__ = shardspeed.__git_branch__
__path__: list[str] = []  # submodules come only from the finder below, never from files next to this one


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported `shardspeed.X` module instead of creating a new one."""

    def __init__(self, module) -> None:
        self.module = module
        self.original_spec = module.__spec__

    def create_module(self, spec):
        return self.module  # importlib keeps its __name__, __loader__, __file__ and __path__ ...

    def exec_module(self, module) -> None:
        # ... but always sets `__spec__` to the alias's spec: give the module its own back, so that
        # `shardspeed.X.__spec__.name` stays "shardspeed.X" (reload, pickling by module, tools reading specs).
        module.__spec__ = self.original_spec

    def get_code(self, fullname):
        """`python -m deepspeed.X` (runpy): the code of the shardspeed module, run as `__main__`."""
        return self.original_spec.loader.get_code(self.original_spec.name)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves `deepspeed.X.Y` to `shardspeed.X.Y` (imported on demand)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(ALIAS + "."):
            return None
        target_name = TARGET + fullname[len(ALIAS) :]
        try:
            module = importlib.import_module(target_name)
        except ModuleNotFoundError as error:
            if error.name != target_name:
                raise  # a real import error inside shardspeed: show it, not a misleading "no module"
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(module), is_package=hasattr(module, "__path__")
        )


def __getattr__(name: str):
    value = getattr(shardspeed, name)  # AttributeError names 'shardspeed', which is where the name is missing
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(shardspeed)))


refuse_real_package(ALIAS, __file__, ALIAS_MARKER, "DeepSpeed itself")
if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
