"""Stand-ins for DeepSpeed names shardspeed does not offer: importable, and an error naming them when used.

DeepSpeed code often imports far more than it uses (a test file imports the autotuner next to the engine; a
training script imports `DeepSpeedTransformerLayer` behind a flag). So a name we do not offer still
imports: it resolves to a stand-in class, and constructing or calling it raises `NotOfferedError`, which
says which DeepSpeed name it was and why shardspeed has no counterpart. No object is ever an instance of a
stand-in, so `isinstance` checks against one answer False, as they should. A stand-in for an exception class
(a name ending in Error or Exception) is an exception class, so `except` clauses and `pytest.raises` naming it
stay valid: nothing ever raises it.
"""

from __future__ import annotations

import types

__all__ = ["NotOffered", "NotOfferedError", "not_offered_class", "not_offered_module"]


class NotOfferedError(NotImplementedError):
    """A DeepSpeed name shardspeed does not offer was used (the message names it and says why)."""


class NotOffered:
    """A table entry (shardspeed/compat/paths.py): this DeepSpeed path is not offered, for `reason`.

    `module=True`: the path is a module (it and everything under it import as stand-ins); otherwise a name.
    """

    __slots__ = ("module", "reason")

    def __init__(self, reason: str, module: bool = False) -> None:
        self.reason = reason
        self.module = module

    def __repr__(self) -> str:
        return f"NotOffered({self.reason!r}, module={self.module})"


# DeepSpeed exception classes whose names do not end in Error or Exception
_EXCEPTIONS_NAMED_OTHERWISE = frozenset({"ElasticityIncompatibleWorldSize"})


def _message(deepspeed_path: str, reason: str, package: str = "deepspeed") -> str:
    return f"{package}.{deepspeed_path} is not offered by shardspeed: {reason}"


class _StandInMeta(type):
    """Calling a stand-in class (to construct it, or as a function) raises NotOfferedError; a name under it
    (`helper.convert` where `helper` is a module DeepSpeed has and shardspeed does not) is a stand-in too."""

    def __call__(cls, *args, **kwargs):
        raise NotOfferedError(_message(cls._deepspeed_path, cls._reason, cls._package))

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return not_offered_class(f"{cls._deepspeed_path}.{name}", cls._reason, cls._package)


def not_offered_class(deepspeed_path: str, reason: str, package: str = "deepspeed") -> type:
    """A class named as the DeepSpeed name whose construction (or call) raises NotOfferedError. `package`:
    the package the path is in (`fairscale` for the FairScale alias's paths)."""
    name = deepspeed_path.rsplit(".", 1)[-1]
    namespace = {
        "_deepspeed_path": deepspeed_path,
        "_reason": reason,
        "_package": package,
        "__doc__": _message(deepspeed_path, reason, package),
        "__module__": "shardspeed.compat.not_offered",
        "__qualname__": name,
    }
    bases = (
        (Exception,) if name.endswith(("Error", "Exception")) or name in _EXCEPTIONS_NAMED_OTHERWISE else ()
    )
    return _StandInMeta(name, bases, namespace)


class NotOfferedModule(types.ModuleType):
    """A DeepSpeed module shardspeed does not offer: it imports, and each public name in it is a stand-in
    (or, where the table lists the name itself, what the table says)."""

    def __init__(self, name: str, deepspeed_path: str, reason: str, listed) -> None:
        super().__init__(name, _message(deepspeed_path, reason))
        self._deepspeed_path = deepspeed_path
        self._reason = reason
        self._listed = listed  # the finder's look-up of a path in the table (it owns the table)
        self.__path__ = []  # submodules are stand-ins too (the finder answers them)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)  # tools probe dunders (`__file__`, `__wrapped__`): plain absence
        path = f"{self._deepspeed_path}.{name}"
        # a name the table places somewhere (utils.timer.trim_mean) is that object, the rest stand-ins
        value = self._listed(path)
        if value is None:
            value = not_offered_class(path, self._reason)
        setattr(self, name, value)
        return value


def not_offered_module(name: str, deepspeed_path: str, reason: str, listed) -> NotOfferedModule:
    """The stand-in module; `listed(path)` is what the table places at `path` under it, or None."""
    return NotOfferedModule(name, deepspeed_path, reason, listed)
