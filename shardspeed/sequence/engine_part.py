"""`SequenceParallelism`: the engine's part for Ulysses — where data is sharded and how batches are sliced.

The engine averages gradients over the sequence-data group (every rank with the same parameters); this part
answers the two questions that differ from plain data parallelism: over how many replicas the data loader
splits samples (the data axis only — the ranks of a sequence group draw the same samples), and which slice
of each sequence this rank keeps. Without sequence parallelism it is a pass-through.
"""

from __future__ import annotations

from shardspeed.sequence.data import SequenceShardedLoader

__all__ = ["SequenceParallelism"]


class SequenceParallelism:
    def __init__(
        self, group=None, degree: int = 1, data_degree: int | None = None, data_rank: int | None = None
    ):
        self.group, self.degree = group, degree
        self._data_degree, self._data_rank = data_degree, data_rank

    @classmethod
    def from_mpu(cls, mpu) -> SequenceParallelism:
        degree = (
            mpu.get_sequence_parallel_world_size() if hasattr(mpu, "get_sequence_parallel_world_size") else 1
        )
        if degree == 1:
            return cls()
        return cls(mpu.get_sequence_parallel_group(), degree, mpu.get_data_parallel_world_size(),
                   mpu.get_data_parallel_rank())  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.degree > 1

    def data_world_size(self, replicas: int) -> int:
        """Data-loader replicas: `replicas` (the gradient group's size) without sequence parallelism."""
        return self._data_degree if self.enabled else replicas

    def data_rank(self, replica_rank: int) -> int:
        return self._data_rank if self.enabled else replica_rank

    def shard_loader(self, loader):
        return SequenceShardedLoader(loader, self.group) if self.enabled else loader
