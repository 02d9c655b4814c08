"""FairScale's API on shardspeed's machinery (the `fairscale` alias package, integrations/fairscale-alias).

FairScale's names map onto the features shardspeed already has: `OSS` is ZeRO stage 1 (oss.py),
`ShardedDataParallel` with an OSS is ZeRO stage 2 (sharded_ddp.py). docs/compatibility.md ("FairScale")
lists every name and what differs. shardspeed/compat/fairscale_paths.py places FairScale's import paths.
"""

from shardspeed.fairscale.oss import OSS
from shardspeed.fairscale.sharded_ddp import ShardedDataParallel

__all__ = ["OSS", "ShardedDataParallel"]
