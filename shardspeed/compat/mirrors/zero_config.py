"""DeepSpeed's `runtime.zero.config.DeepSpeedZeroConfig`, built the way DeepSpeed code builds it.

DeepSpeed code (and its tests) make the ZeRO block on its own: `DeepSpeedZeroConfig(**zero_optimization)`,
then read it under DeepSpeed's field names (`prefetch_bucket_size` for the key `stage3_prefetch_bucket_size`,
...). This is shardspeed's `ZeroConfig`, checked by the one config system exactly as `initialize` checks the
block (deprecated forms such as `cpu_offload_param: true` mapped, aliases, types and ranges checked, errors
naming the key; the checks across blocks are left to `initialize`, as DeepSpeed leaves them to its engine),
with those names as read-only properties. `overlap_comm` keeps shardspeed's default (on at every stage;
docs/compatibility.md says why), not DeepSpeed's (on at stage 3 only). An invalid value raises pydantic's
`ValidationError`, as DeepSpeed's pydantic class does, with the config system's message naming the key.
Deprecated forms are mapped and logged with `logger.warning`, as DeepSpeed's class logs them.
"""

from __future__ import annotations

import dataclasses

from shardspeed.config.build import BuildContext, _schema, build_block
from shardspeed.config.deprecated import map_deprecated
from shardspeed.config.errors import ConfigError
from shardspeed.config.zero import ZeroConfig
from shardspeed.utils.logging import logger

__all__ = ["DeepSpeedZeroConfig"]


class _BlockAlone(ZeroConfig):
    """The block without the checks that relate it to the rest of a training setup (`offload_param` needs
    stage 3, ...): `initialize` makes those; DeepSpeed's class alone does not either."""

    def validate(self, path: str) -> None:
        pass


class DeepSpeedZeroConfig(ZeroConfig):
    """`DeepSpeedZeroConfig(**block)`: the `zero_optimization` block, checked; DeepSpeed's field names too."""

    def __init__(self, **block) -> None:
        ctx = BuildContext()
        try:
            mapped = map_deprecated({"zero_optimization": dict(block)}, ctx)["zero_optimization"]
            built = build_block(_BlockAlone, mapped, "zero_optimization", ctx)
        except ConfigError as error:
            # DeepSpeed's class is a pydantic model: its callers catch ValidationError (without pydantic
            # installed, the ConfigError itself)
            raise _validation_error(error, block) from error
        for f in dataclasses.fields(ZeroConfig):
            setattr(self, f.name, getattr(built, f.name))
        for note in ctx.notes:  # deprecations: DeepSpeed's class logs them through its logger
            logger.warning(note)


def _validation_error(error: ConfigError, block: dict):
    """pydantic's ValidationError (a ValueError, as ConfigError is) carrying the config system's message,
    located at the block's key it names; the ConfigError itself where pydantic is not installed."""
    try:
        from pydantic_core import InitErrorDetails, ValidationError
    except ImportError:
        return error

    named = str(error).split(":", 1)[0].removeprefix("zero_optimization.").split(".")[0]
    detail = InitErrorDetails(
        type="value_error", loc=(named,), input=block.get(named), ctx={"error": ValueError(str(error))}
    )
    return ValidationError.from_exception_data("DeepSpeedZeroConfig", [detail])


# DeepSpeed's field names are the keys' synonyms in the schema (`max_reuse_distance` for
# `stage3_max_reuse_distance`, ...): each reads its key.
_SCHEMA = _schema(ZeroConfig)
for _name in _SCHEMA.synonyms:
    setattr(DeepSpeedZeroConfig, _name, property(lambda self, key=_SCHEMA.aliases[_name]: getattr(self, key)))
