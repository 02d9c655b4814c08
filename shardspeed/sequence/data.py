"""Sequence sharding of training batches: every rank of a sequence group takes its slice of each sequence.

The data loader is sharded over the data axis only, so the ranks of one sequence group draw the same samples;
`shard_sequence` then keeps rank r's contiguous slice `[r*S/P, (r+1)*S/P)` of the sequence dimension.

How the sequence dimension is marked: batches are batch-first, as data loaders produce them, so it is
dimension 1 (`seq_dim`) of every tensor in the batch (a tensor, or tuples/lists/dicts of them) that has one;
0-d and 1-d tensors (per-sample values) pass whole. For a dict batch, `keys` limits the slicing to those
entries (ALST slices `input_ids`, `labels`, `position_ids`). Labels must be shifted before slicing (the next
token of a slice's last position lives on the next rank), and a model with positional embeddings should read
the batch's position ids (or `sequence_offset`) rather than assume its slice starts at 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from shardspeed.sequence.comm import check_divisible

__all__ = ["SequenceShardedLoader", "sequence_offset", "shard_sequence"]


def shard_sequence(batch, group, seq_dim: int = 1, keys: Iterable[str] | None = None):
    """This rank's slice of `batch` along `seq_dim`; the length must be divisible by the group size."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    keys = set(keys) if keys is not None else None

    def cut(x):
        if isinstance(x, torch.Tensor):
            if x.dim() <= seq_dim:
                return x
            check_divisible(x.shape[seq_dim], f"the sequence length (dimension {seq_dim} of a batch tensor)",
                            degree)  # fmt: skip
            return x.chunk(degree, dim=seq_dim)[rank]
        if isinstance(x, dict):
            return {k: cut(v) if keys is None or k in keys else v for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(cut(v) for v in x)
        return x

    return cut(batch)


def sequence_offset(local_length: int, group) -> int:
    """Position in the full sequence of this rank's first token (for positional embeddings)."""
    return dist.get_rank(group) * local_length


class SequenceShardedLoader:
    """Wraps a data loader: each batch it yields is `shard_sequence`d for this rank's sequence group."""

    def __init__(self, loader, group, seq_dim: int = 1, keys: Iterable[str] | None = None):
        self.loader, self.group, self.seq_dim, self.keys = loader, group, seq_dim, keys

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield shard_sequence(batch, self.group, self.seq_dim, self.keys)

    def __getattr__(self, name):  # epoch, sampler, state_dict, ...: the wrapped loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
