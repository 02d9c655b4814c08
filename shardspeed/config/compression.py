"""``compression_training`` (DeepSpeed 0.18.9's ``deepspeed.compression`` block): its typed blocks, defined in
``compression_blocks.py`` and exported here, and ``build_compression_config``, which makes the typed block
from whatever ``init_compression`` and friends are given. That function reads whole configs (``loader``)
and built ones (``schema``), both of which sit above the blocks, so it lives here, above all three.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .build import BuildContext, build_block
from .compression_blocks import (  # the names marked noqa: importable here, not in __all__, as before
    TECHNIQUES,  # noqa: F401
    ActivationQuantizationConfig,
    ActivationQuantizationShared,  # noqa: F401
    ChannelPruningConfig,
    CompressionTrainingConfig,
    Fp16MixedQuantizeConfig,  # noqa: F401
    HeadPruningConfig,
    HeadPruningShared,  # noqa: F401
    LayerReductionConfig,
    Method,  # noqa: F401
    PruningShared,  # noqa: F401
    QuantizationType,  # noqa: F401
    RowPruningConfig,
    SparsePruningConfig,
    SparsePruningShared,  # noqa: F401
    WeightQuantizationConfig,
    WeightQuantizationShared,  # noqa: F401
)
from .loader import read_config_source
from .schema import ShardspeedConfig

__all__ = [
    "ActivationQuantizationConfig",
    "ChannelPruningConfig",
    "CompressionTrainingConfig",
    "HeadPruningConfig",
    "LayerReductionConfig",
    "RowPruningConfig",
    "SparsePruningConfig",
    "WeightQuantizationConfig",
    "build_compression_config",
]


def build_compression_config(config: Any) -> CompressionTrainingConfig:
    """The typed block from what ``init_compression`` and friends accept: a DeepSpeed config (dict, JSON
    path, ``ShardspeedConfig``), the ``compression_training`` block itself, or an already typed block."""
    if isinstance(config, CompressionTrainingConfig):
        return config
    if isinstance(config, ShardspeedConfig):
        return config.compression_training
    raw = read_config_source(config)
    names = {f.name for f in fields(CompressionTrainingConfig)}
    if "compression_training" in raw:
        block, path = raw["compression_training"], "compression_training"
    elif raw and set(raw) <= names:
        block, path = raw, "compression_training"
    else:
        block, path = {}, "compression_training"
    return build_block(CompressionTrainingConfig, block or {}, path, BuildContext())
