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

from shardspeed.config.build import BuildContext, build_block
from shardspeed.config.deprecated import map_deprecated
from shardspeed.config.zero import ZeroConfig

__all__ = ["DeepSpeedZeroConfig"]

# DeepSpeed's pydantic field name -> the config key (shardspeed's field name)
_DEEPSPEED_FIELD_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}


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


for _name, _key in _DEEPSPEED_FIELD_NAMES.items():
    setattr(DeepSpeedZeroConfig, _name, property(lambda self, key=_key: getattr(self, key)))
