"""DeepSpeed's `runtime.zero.config.DeepSpeedZeroConfig`, built the way DeepSpeed code builds it.

DeepSpeed code (and its tests) make the ZeRO block on its own: `DeepSpeedZeroConfig(**zero_optimization)`,
then read it under DeepSpeed's field names (`prefetch_bucket_size` for the key `stage3_prefetch_bucket_size`,
...). This is shardspeed's `ZeroConfig`, checked by the one config system exactly as `initialize` checks the
block (deprecated forms such as `cpu_offload_param: true` mapped, aliases, types and ranges checked, errors
naming the key; the checks across blocks are left to `initialize`, as DeepSpeed leaves them to its engine),
with those names as read-only properties. `overlap_comm` keeps shardspeed's default (on at every stage;
docs/compatibility.md says why), not DeepSpeed's (on at stage 3 only).
"""

from __future__ import annotations

import dataclasses

from shardspeed.config.build import BuildContext, _schema, build_block
from shardspeed.config.deprecated import map_deprecated
from shardspeed.config.zero import ZeroConfig

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
        mapped = map_deprecated({"zero_optimization": dict(block)}, ctx)["zero_optimization"]
        built = build_block(_BlockAlone, mapped, "zero_optimization", ctx)
        for f in dataclasses.fields(ZeroConfig):
            setattr(self, f.name, getattr(built, f.name))


# DeepSpeed's field names are the keys' synonyms in the schema (`max_reuse_distance` for
# `stage3_max_reuse_distance`, ...): each reads its key.
_SCHEMA = _schema(ZeroConfig)
for _name in _SCHEMA.synonyms:
    setattr(DeepSpeedZeroConfig, _name, property(lambda self, key=_SCHEMA.aliases[_name]: getattr(self, key)))
