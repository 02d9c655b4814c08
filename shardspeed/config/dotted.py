"""Dotted top-level keys: `"zero_optimization.reduce_bucket_size": 4096` is read as the nested key it names.

TRL's `prepare_deepspeed` builds its reference model's ZeRO-3 config this way (a copy of the policy's config
plus `"zero_optimization.reduce_bucket_size"`, `"zero_optimization.stage3_param_persistence_threshold"` and
`"zero_optimization.stage3_prefetch_bucket_size"` at the top level), meaning the nested keys, as Hugging
Face's `HfDeepSpeedConfig` spells key paths. DeepSpeed 0.19.8 reads its top level by name and never looks at
such keys, so there the reference model silently keeps the policy's sizes; here each dotted key sets the key it
names, with one log line for the config listing them (and any nested value each one replaces).

Rules, applied before anything else reads the config:
- the path is checked against the schema: a dotted key that names nothing is refused by its dotted spelling
  (with the closest valid name), as is one that reaches into a value that is not an object. Free-form
  objects (`optimizer.params`, ...) take any key below them, as they do nested;
- the dotted key wins over the nested one (TRL adds them to override what the copied config says); the block
  is created if absent; two dotted keys for one field (a name and its synonym) are refused;
- a fractional number for an element-count field is rounded down, and the log line says so. TRL computes
  `0.9 * hidden * hidden` for `stage3_prefetch_bucket_size` (3686.4 for hidden size 64); HF's own "auto"
  fill of the same key is `int(0.9 * hidden * hidden)`. Written nested, a fraction stays an error: only the
  dotted spelling, which frameworks compute, is rounded.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import types
from typing import Annotated, Any, Union, get_args, get_origin

from .build import field_of, join, key_names, show
from .errors import ConfigError, closest_name

__all__ = ["expand_dotted_keys"]

_log = logging.getLogger("shardspeed.config")  # a child of the package logger: printed by its handler


def expand_dotted_keys(config: dict[str, Any], root: type) -> None:
    """Move every dotted top-level key of `config` (modified in place) to the nested key it names in the
    schema `root`; log one line listing them."""
    dotted = [key for key in config if isinstance(key, str) and "." in key]
    if not dotted:
        return
    written: dict[tuple, str] = {}  # (block id, field) -> the dotted key that set it
    notes = []
    for key in dotted:
        value = config.pop(key)
        notes.append(_place(config, root, key, value, written))
    if _rank() == 0:
        _log.info("config: dotted top-level keys read as the nested keys they name: " + "; ".join(notes))


def _place(config: dict, root: type, key: str, value: Any, written: dict) -> str:
    """Write `value` at the path `key` names; return what happened, for the log line."""
    *parents, last = key.split(".")
    block, cls, path = config, root, ""
    for part in parents:
        name, hint = _resolve(cls, part, key, path)
        path = join(path, part)
        if hint is not None and _block_class(hint) is None and not _free_form(hint):
            raise ConfigError(f"unknown key '{key}' (a dotted key): '{path}' is a value, not a block of keys")
        block = _child_object(block, cls, part, name, key, path)
        cls = _block_class(hint) if hint is not None else None
    name, hint = _resolve(cls, last, key, path)
    replaced = _remove_same_field(block, cls, name, last, key, written)
    note = f"{key}={show(value)}"
    if hint is not None and _is_count(hint) and _is_fraction(value):
        value = math.floor(value)
        note += f" (an element count: rounded down to {value})"
    if replaced is not None:
        note += f" (replaces {show(replaced)})"
    block[last] = value
    written[(id(block), name)] = key
    return note


def _resolve(cls: type | None, part: str, key: str, path: str) -> tuple[str, Any]:
    """(field, annotation) of `part` in block `cls`; (part, None) under a free-form object."""
    if cls is None:
        if not part:
            raise ConfigError(f"unknown key '{key}' (a dotted key): an empty name after '{path}'")
        return part, None
    found = field_of(cls, part)
    if found is not None:
        return found
    names, keeps_extras = key_names(cls)
    if keeps_extras and part:
        return part, None
    close = closest_name(part, names)
    hint = f"; did you mean '{join(path, close)}'?" if close else ""
    where = f"in '{path}'" if path else "at top level"
    raise ConfigError(f"unknown key '{key}' (a dotted key): '{part}' is not a key {where}{hint}")


def _child_object(block: dict, cls: type | None, part: str, name: str, key: str, path: str) -> dict:
    """The object at `part` of `block` (under any spelling of the same field), created if absent."""
    spellings = [k for k in block if k == part or (cls is not None and _same_field(cls, k, name))]
    if not spellings:
        block[part] = {}
        return block[part]
    child = block[spellings[0]]
    if not isinstance(child, dict):
        raise ConfigError(
            f"'{key}' (a dotted key) names a key inside '{path}', which is {show(child)}, not an object"
        )
    return child


def _remove_same_field(block: dict, cls: type | None, name: str, last: str, key: str, written: dict):
    """Drop the nested spellings of the field `name` (the dotted key overrides them); return the value
    dropped, or None."""
    earlier = written.get((id(block), name))
    if earlier is not None:
        raise ConfigError(f"'{key}' and '{earlier}': one key given twice (as two dotted names); keep one")
    replaced = None
    for spelling in [k for k in block if k == last or (cls is not None and _same_field(cls, k, name))]:
        replaced = block.pop(spelling)
    return replaced


def _same_field(cls: type, key: Any, name: str) -> bool:
    found = field_of(cls, key) if isinstance(key, str) else None
    return found is not None and found[0] == name


# -- the type annotations of config fields ------------------------------------------------------------------


def _arms(hint: Any) -> list[Any]:
    """The types a value may take under `hint` (Annotated and Optional unwrapped, unions flattened)."""
    if get_origin(hint) is Annotated:
        return _arms(get_args(hint)[0])
    if get_origin(hint) in (Union, types.UnionType):
        return [arm for part in get_args(hint) if part is not type(None) for arm in _arms(part)]
    return [hint]


def _block_class(hint: Any) -> type | None:
    blocks = [arm for arm in _arms(hint) if dataclasses.is_dataclass(arm)]
    return blocks[0] if len(blocks) == 1 else None


def _free_form(hint: Any) -> bool:
    return any(arm is Any or arm is dict or get_origin(arm) is dict for arm in _arms(hint))


def _is_count(hint: Any) -> bool:
    arms = _arms(hint)
    return int in arms and float not in arms


def _is_fraction(value: Any) -> bool:
    return (
        isinstance(value, float) and value == value and abs(value) != float("inf") and not value.is_integer()
    )


def _rank() -> int:
    """The global rank if torch.distributed is loaded and initialised, else 0 (config never imports it)."""
    dist = sys.modules.get("torch.distributed")
    return dist.get_rank() if dist is not None and dist.is_available() and dist.is_initialized() else 0
