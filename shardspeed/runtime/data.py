"""Training data: a DataLoader that gives each data-parallel rank its own shard, and `RepeatingLoader`.

The order is DeepSpeed's: `DistributedSampler` over the data-parallel ranks with its default seed 0, shuffled
on the training route and in order elsewhere (the pipeline engine reads in order too; see
`pipeline_engine.py`); the sampler never drops samples (it pads the last round with the first ones) and
`drop_last` drops the last incomplete batch, as DeepSpeed's loader does. One difference: DeepSpeed never
calls `set_epoch`, so every epoch repeats the first epoch's permutation; here epoch e uses the permutation of
seed 0 + e (epoch 0 is DeepSpeed's), as PyTorch's sampler documentation asks.

`sampler_state(loader)` is the loader's checkpoint part: its epoch under `data_sampler`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from shardspeed.checkpoint.parts import NamedState


class ShardedDataLoader:
    """Micro-batches of `dataset` for one data-parallel rank, reshuffled every epoch when `shuffle`.

    A map-style dataset is split by `DistributedSampler` (each rank sees a disjoint 1/N of every epoch; the
    permutation changes with the epoch so ranks stay in step). An iterable dataset is the user's to shard.
    `tput_timer`: the engine's throughput timer, started as each batch is fetched (loading counts).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        num_replicas: int,
        rank: int,
        collate_fn: Callable | None = None,
        drop_last: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        data_sampler=None,
        seed: int = 0,
        tput_timer=None,
    ):
        self.epoch = 0
        self.tput_timer = tput_timer
        if isinstance(dataset, IterableDataset):
            self.sampler = None
        elif data_sampler is not None:
            self.sampler = data_sampler
        else:
            # drop_last stays the loader's: DeepSpeed's sampler pads, so every rank gets as many samples
            self.sampler = DistributedSampler(
                dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
            )
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory and torch.cuda.is_available(),
        )

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        if self.tput_timer is None:
            return iter(self.loader)
        return _TimedBatches(iter(self.loader), self.tput_timer)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])


class _TimedBatches:
    """The loader's batches, each starting a micro-step of the throughput timer before it is loaded."""

    def __init__(self, batches: Iterator, tput_timer):
        self.batches, self.tput_timer = batches, tput_timer

    def __iter__(self):
        return self

    def __next__(self):
        self.tput_timer.start_at_fetch()
        try:
            return next(self.batches)
        except StopIteration:
            self.tput_timer.discard()  # the epoch is over: no micro-step runs on this fetch
            raise


def sampler_state(loader) -> NamedState:
    """The checkpoint part of the engine's training loader (None without one: nothing saved or loaded)."""
    return NamedState("data_sampler", loader)


class RepeatingLoader:
    """Wraps an iterable so that it restarts (a new epoch) instead of raising StopIteration."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
