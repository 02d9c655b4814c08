"""FairScale's API on shardspeed's machinery (the `fairscale` alias package, integrations/fairscale-alias).

FairScale's names map onto the features shardspeed already has: `OSS` is ZeRO stage 1 (oss.py),
`ShardedDataParallel` with an OSS is ZeRO stage 2 (sharded_ddp.py), `FullyShardedDataParallel` is ZeRO stage 3
with its parameters sharded per wrapped module (fsdp.py; nesting with wrap.py), `OffloadModel` is parameter
offload slice by slice (offload_model.py), `checkpoint_wrapper` is activation checkpointing
(checkpoint_wrapper.py), `FlattenParamsWrapper` packs a module's parameters into flat ones
(flatten_params.py), `AdaScale` scales the learning rate by the gain of a larger batch (adascale.py)
and `Pipe` runs a sequential model in micro-batches over devices (pipe.py). docs/compatibility.md ("FairScale")
lists every name and what differs. shardspeed/compat/fairscale_paths.py places FairScale's import paths.
"""

from shardspeed.fairscale.adascale import AdaScale, AdaScaleWrapper
from shardspeed.fairscale.checkpoint_wrapper import checkpoint_wrapper
from shardspeed.fairscale.flatten_params import FlattenParamsWrapper
from shardspeed.fairscale.fsdp import FullyShardedDataParallel
from shardspeed.fairscale.offload_model import OffloadModel
from shardspeed.fairscale.oss import OSS
from shardspeed.fairscale.pipe import Pipe
from shardspeed.fairscale.sharded_ddp import ShardedDataParallel
from shardspeed.fairscale.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    wrap,
)

__all__ = [
    "OSS",
    "AdaScale",
    "AdaScaleWrapper",
    "FlattenParamsWrapper",
    "FullyShardedDataParallel",
    "OffloadModel",
    "Pipe",
    "ShardedDataParallel",
    "auto_wrap",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "wrap",
]
