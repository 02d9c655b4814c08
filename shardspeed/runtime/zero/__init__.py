"""DeepSpeed's `deepspeed.runtime.zero` path: the same `Init` and `GatheredParameters` as `shardspeed.zero`.

Integrations import ZeRO from here (`deepspeed.runtime.zero.GatheredParameters`,
`deepspeed.runtime.zero.partition_parameters`); the implementation lives in `shardspeed/zero/`.
"""

from shardspeed.runtime.zero import partition_parameters
from shardspeed.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
