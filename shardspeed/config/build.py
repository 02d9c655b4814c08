"""Turns JSON-like dicts into the typed config dataclasses: type checks, ranges, aliases, unknown keys.

Every config block is a plain ``@dataclass(kw_only=True)``. A field's JSON contract lives in its type
annotation: ``Annotated[int, Key(gt=0, aliases=("old_name",))]``. ``build_block`` is the only code that
reads user values, so every block gets the same checks and the same error wording:

* a JSON ``true`` for an int field is an error (``bool`` is an ``int`` in Python, not in a config);
* a float such as ``5e8`` for an int field is accepted when integral;
* a string where a number is expected is an error;
* an unknown key is an error naming the full path and suggesting the closest valid key;
* a deprecated alias is mapped to its field with a note (warned once per load by the loader); giving
  both the alias and the new name is an error.

A block may define ``validate(self, path)`` for checks across its own fields; it runs right after the
block is built, with the block's key path for error messages.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from .errors import ConfigError, closest_name

__all__ = ["BuildContext", "ConfigWarning", "Key", "build_block", "field_of", "join", "key_names", "show"]


class ConfigWarning(UserWarning):
    """A config was accepted, but part of it deserves attention (a deprecated key, an unimplemented feature)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Key:
    """JSON-side rules of one field, carried in its ``Annotated[...]`` type."""

    ge: float | None = None
    """Smallest allowed value (inclusive)."""
    gt: float | None = None
    """Values must be strictly greater than this."""
    le: float | None = None
    """Largest allowed value (inclusive)."""
    aliases: tuple[str, ...] = ()
    """Deprecated key names mapped onto this field, with a warning."""
    synonyms: tuple[str, ...] = ()
    """Equally valid names DeepSpeed also accepts (e.g. ZeRO's short stage-3 names): mapped silently."""
    normalize: Callable[[Any], Any] | None = None
    """Applied to the user's value before type checking (e.g. case-folding a mode name)."""
    internal: bool = False
    """Not a JSON key: set by the loader (``raw``, ``world_size``); a user key of this name is unknown."""

    def check_range(self, value: Any, path: str) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return
        if self.gt is not None and not value > self.gt:
            raise ConfigError(f"{path}: must be > {_num(self.gt)}, got {show(value)}")
        if self.ge is not None and not value >= self.ge:
            raise ConfigError(f"{path}: must be >= {_num(self.ge)}, got {show(value)}")
        if self.le is not None and not value <= self.le:
            raise ConfigError(f"{path}: must be <= {_num(self.le)}, got {show(value)}")


@dataclasses.dataclass
class BuildContext:
    """What one load learns on the way through the config."""

    notes: list[str] = dataclasses.field(default_factory=list)
    """Deprecation messages, warned by the loader once the whole config has been accepted."""
    given: set[str] = dataclasses.field(default_factory=set)
    """Canonical key paths the user wrote (``zero_optimization.stage``), for the unimplemented-key warning."""


def join(path: str, key: str) -> str:
    """``join("", "fp16") == "fp16"``; ``join("fp16", "enabled") == "fp16.enabled"``."""
    return f"{path}.{key}" if path else key


def show(value: Any) -> str:
    """A value as the user wrote it in JSON (``true``, ``"5"``), shortened for messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --------------------------------------------------------------------------------------------------
# Schema of a block class (cached): field types, aliases, required keys.


@dataclasses.dataclass(frozen=True)
class _Schema:
    hints: dict[str, Any]
    keys: dict[str, Key]
    aliases: dict[str, str]
    synonyms: frozenset[str]
    required: tuple[str, ...]
    extra_field: str | None


def _keys_of(hint: Any) -> list[Key]:
    """The ``Key`` rules of an ``Annotated`` hint; nested Annotated types are flattened by Python."""
    if get_origin(hint) is not Annotated:
        return []
    return [extra for extra in get_args(hint)[1:] if isinstance(extra, Key)]


def _outer_key(hint: Any) -> Key:
    keys = _keys_of(hint)
    aliases = tuple(alias for key in keys for alias in key.aliases)
    synonyms = tuple(name for key in keys for name in key.synonyms)
    return Key(aliases=aliases, synonyms=synonyms, internal=any(key.internal for key in keys))


@functools.cache
def _schema(cls: type) -> _Schema:
    all_hints = typing.get_type_hints(cls, include_extras=True)
    hints, keys, aliases, required, synonyms = {}, {}, {}, [], set()
    for f in dataclasses.fields(cls):
        key = _outer_key(all_hints[f.name])
        if key.internal:
            continue
        hints[f.name], keys[f.name] = all_hints[f.name], key
        aliases.update(dict.fromkeys(key.aliases + key.synonyms, f.name))
        synonyms.update(key.synonyms)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    extra = getattr(cls, "EXTRA_KEYS_FIELD", None)
    return _Schema(hints, keys, aliases, frozenset(synonyms), tuple(required), extra)


def field_of(cls: type, key: str) -> tuple[str, Any] | None:
    """(field name, type annotation) of the user key ``key`` in block ``cls`` (a synonym or deprecated alias
    names its field); None when ``cls`` has no such key."""
    schema = _schema(cls)
    name = key if key in schema.hints else schema.aliases.get(key)
    return None if name is None else (name, schema.hints[name])


def key_names(cls: type) -> tuple[list[str], bool]:
    """The keys block ``cls`` accepts (fields, synonyms, aliases), and whether it also keeps unknown keys."""
    schema = _schema(cls)
    return [*schema.hints, *schema.aliases], schema.extra_field is not None


# --------------------------------------------------------------------------------------------------
# Building a block.


def build_block(cls: type, data: Any, path: str, ctx: BuildContext) -> Any:
    """Build dataclass ``cls`` from the JSON object ``data`` found at key ``path`` ("" = top level)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected an object ({{...}}), got {show(data)}")
    schema = _schema(cls)
    kwargs: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for raw_key, value in data.items():
        name = _canonical_name(schema, raw_key, data, path, ctx)
        if name is None:
            extras[raw_key] = copy.deepcopy(value)
            ctx.given.add(join(path, str(raw_key)))
            continue
        if name in kwargs:
            raise ConfigError(f"{join(path, name)}: given twice (under two alias names); keep one")
        kwargs[name] = coerce(schema.hints[name], value, join(path, name), ctx)
        ctx.given.add(join(path, name))
    missing = [name for name in schema.required if name not in kwargs]
    if missing:
        example = getattr(cls, "REQUIRED_EXAMPLE", "")
        raise ConfigError(f"{join(path, missing[0])}: required key missing{example}")
    if schema.extra_field is not None:
        kwargs[schema.extra_field] = extras
    block = cls(**kwargs)
    validate = getattr(block, "validate", None)
    if validate is not None:
        validate(path)
    return block


def _canonical_name(schema: _Schema, key: Any, data: dict, path: str, ctx: BuildContext) -> str | None:
    """The field name for user key ``key``; None for an extra key of a block that collects them."""
    if key in schema.hints:
        return key
    if key in schema.aliases:
        new = schema.aliases[key]
        if new in data:
            raise ConfigError(
                f"{join(path, key)}: both '{join(path, key)}' and its new name '{join(path, new)}' are given; "
                f"remove '{join(path, key)}'"
            )
        if key not in schema.synonyms:
            ctx.notes.append(
                f"config key '{join(path, key)}' is a deprecated name; its value was used as "
                f"'{join(path, new)}' (rename it to silence this warning)"
            )
        return new
    if schema.extra_field is not None:
        return None
    raise ConfigError(_unknown_key_message(schema, key, path))


def _unknown_key_message(schema: _Schema, key: Any, path: str) -> str:
    candidates = {name: name for name in schema.hints} | schema.aliases
    close = closest_name(str(key), candidates)
    where = f"'{key}' at top level" if not path else f"'{join(path, str(key))}'"
    if close:
        return f"unknown key {where}; did you mean '{join(path, candidates[close])}'?"
    if not path:
        return f"unknown key {where}: not a DeepSpeed/shardspeed config key"
    return f"unknown key {where}; valid keys in '{path}' are: {', '.join(sorted(schema.hints))}"


# --------------------------------------------------------------------------------------------------
# Checking one value against a type annotation.


def coerce(tp: Any, value: Any, path: str, ctx: BuildContext) -> Any:
    """Check ``value`` against annotation ``tp`` and return it converted (``5e8`` -> ``500000000``)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _coerce_annotated(tp, value, path, ctx)
    if origin in (Union, types.UnionType):
        return _coerce_union(tp, value, path, ctx)
    if origin is Literal:
        return _coerce_literal(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(tp, value, path)
        (item_type,) = get_args(tp)
        return [coerce(item_type, item, f"{path}[{i}]", ctx) for i, item in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(tp, value, path)
        item_type = get_args(tp)[1] if get_args(tp) else Any
        if dataclasses.is_dataclass(item_type):  # user-named entries of one block type (compression groups)
            return {
                key: build_block(item_type, item, join(path, str(key)), ctx) for key, item in value.items()
            }
        # Free-form object (optimizer.params, ...): passed through; its consumer validates it.
        return copy.deepcopy(value)
    if tp is Any:
        return copy.deepcopy(value)
    if dataclasses.is_dataclass(tp):
        return build_block(tp, value, path, ctx)
    return _coerce_scalar(tp, value, path)


def _coerce_annotated(tp: Any, value: Any, path: str, ctx: BuildContext) -> Any:
    keys = _keys_of(tp)
    for key in keys:
        if key.normalize is not None:
            value = key.normalize(value)
    result = coerce(get_args(tp)[0], value, path, ctx)
    for key in keys:
        key.check_range(result, path)
    return result


def _coerce_union(tp: Any, value: Any, path: str, ctx: BuildContext) -> Any:
    arms = [arm for arm in get_args(tp) if arm is not type(None)]
    if value is None and len(arms) < len(get_args(tp)):
        return None
    if len(arms) == 1:
        return coerce(arms[0], value, path, ctx)
    for arm in arms:
        try:
            return coerce(arm, value, path, ctx)
        except ConfigError:
            continue
    raise _type_error(tp, value, path)


def _coerce_literal(tp: Any, value: Any, path: str) -> Any:
    choices = get_args(tp)
    if isinstance(value, enum.Enum):  # a member of DeepSpeed's enums (OffloadDeviceEnum.cpu) is its value
        value = value.value
    if all(isinstance(c, int) for c in choices) and _is_number(value):
        value = _coerce_scalar(int, value, path) if float(value).is_integer() else value
    for choice in choices:
        if type(choice) is type(value) and choice == value:
            return choice
    rendered = ", ".join(str(c) if isinstance(c, int) else f"'{c}'" for c in choices)
    raise ConfigError(f"{path}: must be one of {rendered}, got {show(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _coerce_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    if tp is bool and type(value) is int and value in (0, 1):
        return bool(value)  # DeepSpeed's (pydantic) blocks take 0/1, and its own tests write them
    if tp is int and _is_number(value) and float(value).is_integer():
        return int(value)
    if tp is float and _is_number(value):
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    raise _type_error(tp, value, path)


def _type_error(tp: Any, value: Any, path: str) -> ConfigError:
    message = f"{path}: expected {describe(tp)}, got {show(value)}"
    if isinstance(value, str) and tp in (int, float):
        message += " (a string: write the number without quotes)"
    elif isinstance(value, bool) and tp in (int, float):
        message += " (a boolean is not a number here)"
    return ConfigError(message)


_SCALAR_NAMES: dict[Any, str] = {
    bool: "a boolean (true/false)",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "null",
    Any: "any value",
}


def describe(tp: Any) -> str:
    """A type annotation in words, for error messages."""
    origin = get_origin(tp)
    if origin is Annotated:
        return describe(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return " or ".join(describe(arm) for arm in get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(show(c) for c in get_args(tp))
    if origin is list:
        return f"a list of ({describe(get_args(tp)[0])})"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "an object ({...})"
    return _SCALAR_NAMES.get(tp, getattr(tp, "__name__", str(tp)))
