"""DeepSpeed-Ulysses sequence parallelism (`deepspeed.sequence`): attention, its all-to-all, data and loss.

See docs/architecture.md ("Sequence parallelism") for how the parts fit with the engine.
"""

from shardspeed.sequence.data import SequenceShardedLoader, sequence_offset, shard_sequence
from shardspeed.sequence.layer import DistributedAttention
from shardspeed.sequence.loss import sequence_parallel_mean

__all__ = [
    "DistributedAttention",
    "SequenceShardedLoader",
    "sequence_offset",
    "sequence_parallel_mean",
    "shard_sequence",
]
