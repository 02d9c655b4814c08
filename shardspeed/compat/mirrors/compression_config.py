"""``deepspeed.compression.config``: the ``compression_training`` block of a config, with defaults filled in.

The block is typed and checked in shardspeed/config/compression.py; ``get_compression_config`` returns it
as DeepSpeed's nested dict (technique -> ``shared_parameters`` / ``different_groups``) for scripts that
read it that way.
"""

from __future__ import annotations

import dataclasses

from shardspeed.config.compression import CompressionTrainingConfig, build_compression_config

__all__ = ["CompressionTrainingConfig", "get_compression_config"]


def get_compression_config(param_dict) -> dict:
    """The resolved ``compression_training`` block of ``param_dict`` (a config dict or path) as a dict."""
    return dataclasses.asdict(build_compression_config(param_dict))
