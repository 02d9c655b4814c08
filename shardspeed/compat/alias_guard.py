"""The check both alias packages (`deepspeed`, `fairscale`) run when imported: the real package must not be
importable beside them, or which one a program gets would depend on sys.path order."""

from __future__ import annotations

import importlib.machinery
import os
import sys

__all__ = ["refuse_real_package"]


def refuse_real_package(name: str, alias_file: str, marker: str, real: str) -> None:
    """Raise ImportError if another package `name` (`real`, e.g. "DeepSpeed itself") is on sys.path besides the
    alias whose `__init__.py` is `alias_file`. Another copy of the alias (its file holds `marker`: installed,
    and staged on PYTHONPATH) is harmless."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(alias_file)))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec(name, others)
    if spec is None or not spec.origin or os.path.realpath(spec.origin) == os.path.realpath(alias_file):
        return
    try:
        with open(spec.origin, encoding="utf-8", errors="replace") as handle:
            if marker in handle.read(8192):
                return
    except OSError:
        pass
    raise ImportError(
        f"two packages named {name!r} are importable: the shardspeed alias ({alias_file}) and another one at "
        f"{spec.origin} (probably {real}). Remove one: `pip uninstall {name}` removes whichever is installed in "
        f"this environment; reinstall the alias with `pip install ./integrations/{name}-alias` from the "
        "shardspeed repository"
    )
