"""DeepSpeed-Ulysses sequence parallelism (`deepspeed.sequence`): attention, its all-to-all, data and loss;
and ALST (Arctic Long Sequence Training, DeepSpeed's `runtime.sequence_parallel`): Ulysses for Hugging Face
models, its data loader adapter and groups, and tiled compute.

See docs/architecture.md ("Sequence parallelism") for how the parts fit with the engine.
"""

from shardspeed.sequence.data import SequenceShardedLoader, sequence_offset, shard_sequence
from shardspeed.sequence.hf_attention import UlyssesSPAttentionHF
from shardspeed.sequence.hf_data import UlyssesSPDataLoaderAdapter
from shardspeed.sequence.layer import DistributedAttention
from shardspeed.sequence.loss import sequence_parallel_mean
from shardspeed.sequence.tiled import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__ = [
    "DistributedAttention",
    "SequenceShardedLoader",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_offset",
    "sequence_parallel_mean",
    "sequence_tiled_compute",
    "shard_sequence",
]
