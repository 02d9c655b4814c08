"""Errors for engine calls made at the wrong moment (`engine.step()` inside `engine.no_sync()`, ...).

DeepSpeed raises AssertionError for these (its checks are `assert` statements) and its users' code and tests
catch that; shardspeed's error is a RuntimeError, what Python code expects for a call the object's state does
not allow, and an AssertionError too, so both kinds of `except` see it.
"""

from __future__ import annotations

__all__ = ["ArgumentUsageError", "EngineUsageError"]


class EngineUsageError(RuntimeError, AssertionError):
    """An engine method called where it is not allowed; the message says what to do instead."""


class ArgumentUsageError(ValueError, AssertionError):
    """A call's arguments are wrong in a way DeepSpeed checks with `assert` (`initialize()` without a model):
    a ValueError, and an AssertionError for code written against DeepSpeed."""
