"""``load_config``: from a dict, a JSON/HJSON file or a base64 string to a validated ``ShardspeedConfig``.

Order of work: read the source -> dotted top-level keys to the nested keys they name -> refuse keys DeepSpeed 0.19 removed -> drop or refuse "auto" values -> map
deprecated forms -> build and type-check every block -> cross-block checks -> refuse set keys of features
that are not implemented (one error naming them all) -> resolve the batch triple -> warn about deprecations.
No key is accepted and ignored. The caller's dict is never modified.
"""

from __future__ import annotations

import base64
import binascii
import copy
import enum
import json
import os
import warnings
from typing import Any

import hjson

from .batch import resolve_batch_sizes
from .build import BuildContext, ConfigWarning, build_block, join, show
from .deprecated import map_deprecated
from .dotted import expand_dotted_keys
from .errors import ConfigError
from .implemented import refuse_removed, refuse_unsupported
from .schema import ShardspeedConfig
from .validate import check_all

__all__ = ["load_config", "parse_config_text", "read_config_source"]

# Keys where "auto" is a value DeepSpeed itself understands, not an integration placeholder.
NATIVE_AUTO_KEYS = frozenset(
    {
        "pipeline.stages",
        "pipeline.virtual_stages",
        "data_types.keep_in_fp32_modules",
        "zero_optimization.zenflow.select_strategy",
        "zero_optimization.zenflow.select_interval",
        "zero_optimization.zenflow.update_interval",
    }
)
# Blocks whose values go straight into an optimizer or schedule constructor: an "auto" left there cannot
# fall back to a default without silently changing the training (DeepSpeed would crash inside torch).
STRICT_AUTO_BLOCKS = ("optimizer", "scheduler")

_NOT_BASE64 = set("/\\.{}\n\t :\"'")


def load_config(config: Any, world_size: int = 1) -> ShardspeedConfig:
    """Load, validate and resolve a DeepSpeed config.

        ``config``: a dict, a path to a JSON/HJSON file (comments allowed), a urlsafe-base64 string of
        JSON, or a ``ShardspeedConfig`` (re-resolved for ``world_size``). ``world_size``: data-parallel
        size used for the batch arithmetic. Raises ``ConfigError`` (also for a key of a feature that is not
    implemented); warns with ``ConfigWarning`` (deprecated forms).
    """
    if isinstance(config, ShardspeedConfig):
        config = config.raw
    raw = copy.deepcopy(read_config_source(config))
    expand_dotted_keys(raw, ShardspeedConfig)  # `raw` keeps the nested form: one spelling for every reader
    refuse_removed(raw)
    dropped = drop_auto(raw, "")
    ctx = BuildContext()
    if dropped:
        ctx.notes.append(
            '"auto" left unfilled, so the default is used (as DeepSpeed does) for: ' + ", ".join(dropped)
        )
    cfg = build_block(ShardspeedConfig, map_deprecated(copy.deepcopy(raw), ctx), "", ctx)
    check_all(cfg)
    refuse_unsupported(cfg, ctx.given)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = (
        resolve_batch_sizes(
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
            world_size,
        )
    )
    cfg.raw, cfg.world_size = raw, world_size
    for note in ctx.notes:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    _warn_vocabulary_size(cfg.vocabulary_size)
    return cfg


def _warn_vocabulary_size(size: int | None) -> None:
    """DeepSpeed's one use of `vocabulary_size`: a hint that tensor cores want multiples of 8."""
    if size is not None and size % 8:
        warnings.warn(
            f"vocabulary_size {size} is not a multiple of 8; padding it to one can make the embedding and "
            "output layers faster on GPUs (tensor cores)",
            ConfigWarning,
            stacklevel=3,
        )


def read_config_source(config: Any) -> dict[str, Any]:
    """The config as a dict (the caller's own object when a dict is given: copy before changing it)."""
    if isinstance(config, dict):
        return _without_enum_members(config)
    if isinstance(config, os.PathLike):
        return _read_file(os.fspath(config))
    if not isinstance(config, str):
        raise ConfigError(
            f"config: expected a dict, a path to a JSON file or a base64 string, got {type(config).__name__}"
        )
    if os.path.isfile(config):
        return _read_file(config)
    if os.path.exists(config):
        raise ConfigError(f"config: {config!r} is a directory, not a config file")
    if not config.strip() or _NOT_BASE64 & set(config.strip()):
        raise ConfigError(f"config file not found: {config!r}")
    return _read_base64(config)


def _without_enum_members(value: Any) -> Any:
    """`value` with each member of an Enum (DeepSpeed's `OffloadDeviceEnum.cpu`, ...) replaced by its value, as
    DeepSpeed's pydantic config reads it; the same object when it holds none. The config dict is saved in
    checkpoints, whose safe loading accepts plain values only."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        items = {key: _without_enum_members(item) for key, item in value.items()}
        return value if all(items[key] is item for key, item in value.items()) else items
    if isinstance(value, list):
        items = [_without_enum_members(item) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ConfigError(f"config file {path!r} cannot be read: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {path!r} is not UTF-8 text: {error}") from error
    return parse_config_text(text, source=repr(path))


def _read_base64(text: str) -> dict[str, Any]:
    try:
        decoded = base64.urlsafe_b64decode(text.strip()).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(
            f"config: {show(text)} is neither an existing file nor a urlsafe-base64-encoded JSON config"
        ) from error
    return parse_config_text(decoded, source="base64 config")


def parse_config_text(text: str, source: str = "config") -> dict[str, Any]:
    """Parse JSON or HJSON text (comments allowed); duplicate keys and non-object configs are errors.

    Plain JSON is tried first: Python's JSON (and DeepSpeed's reader) accepts `Infinity`, which Accelerate's
    `steps_per_print` produces when a filled-in config is written back to a file; HJSON does not.
    """
    if not text.strip():
        raise ConfigError(f'{source} is empty: a config is a JSON object, e.g. {{"train_batch_size": 32}}')
    try:
        try:
            parsed = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError:
            parsed = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as error:
        raise ConfigError(f"{source}: duplicate key '{error.key}'; each key may appear once") from None
    except hjson.HjsonDecodeError as error:
        raise ConfigError(
            f"{source}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    if parsed == {} and "{" not in text:
        raise ConfigError(f"{source} holds only comments: it sets nothing")
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"{source}: a config must be a JSON object ({{...}}) at top level, got {show(parsed)}"
        )
    return parsed


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def drop_auto(value: dict[str, Any], path: str) -> list[str]:
    """Remove "auto" placeholders from config blocks (in place); return their paths.

    HF Transformers/Accelerate replace "auto" with real values before the config reaches the engine, but
    leave it where they have nothing to fill in. DeepSpeed then drops it inside config blocks, so the field
    takes its default; so does shardspeed, with a warning naming the keys. A top-level key, or a value inside
    the optimizer/scheduler blocks, has no safe default: "auto" there is a ConfigError naming the key.
    """
    dropped = []
    for key, item in list(value.items()):
        where = join(path, str(key))
        if _is_auto(item) and where not in NATIVE_AUTO_KEYS:
            if not path or where.split(".")[0] in STRICT_AUTO_BLOCKS:
                _refuse_auto(where)
            del value[key]
            dropped.append(where)
        elif isinstance(item, dict):
            dropped += drop_auto(item, where)
        elif isinstance(item, list):
            for index, element in enumerate(item):
                if _is_auto(element):
                    _refuse_auto(f"{where}[{index}]")
    return dropped


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _refuse_auto(path: str) -> None:
    raise ConfigError(
        f'{path}: "auto" is not a value: HF Transformers/Accelerate replace "auto" with real values '
        f"before the config reaches the engine. When the config is passed to shardspeed directly, "
        f"give {path} a value"
    )
