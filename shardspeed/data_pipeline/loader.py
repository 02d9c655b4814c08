"""`CurriculumDataLoader`: the engine's training loader when curriculum sampling is on.

A `DataLoader` over the curriculum sampler (`batch_sampler`), as DeepSpeed's `DeepSpeedDataLoader` builds it
in that case: `data_sampling.num_workers` workers, `data_sampling.pin_memory`, and the script's post-process
function (`engine.set_data_post_process_func(fn)`), called as `fn(batch, sampler.state_dict())` on every
batch. Iterating again continues the sampler where it stopped (its state is the curriculum's), so an epoch
loop over the loader draws new batches, never the first ones again.

Its checkpoint state is the sampler's. With `num_workers` > 0 the DataLoader prefetches batches, so the saved
sampler is ahead of the batches the model trained on (DeepSpeed has the same limit); resume is exact with
the default `num_workers` 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader

from .sampler import DeepSpeedDataSampler

__all__ = ["CurriculumDataLoader"]


class CurriculumDataLoader:
    def __init__(self, dataset, data_sampler: DeepSpeedDataSampler, *, batch_size: int, collate_fn=None,
                 num_workers: int = 0, pin_memory: bool = False, drop_last: bool = False, tput_timer=None):  # fmt: skip
        self.dataset = dataset
        self.data_sampler = (
            data_sampler  # DeepSpeed's attribute name (scripts read engine.training_dataloader.data_sampler)
        )
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.num_local_io_workers = num_workers
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.tput_timer = tput_timer
        self.post_process_func: Callable | None = None
        samples = len(data_sampler)
        self.len = samples // batch_size if drop_last else math.ceil(samples / batch_size)
        self._batches = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self):
        options = {"collate_fn": self.collate_fn} if self.collate_fn is not None else {}
        loader = DataLoader(self.dataset, batch_sampler=self.data_sampler, num_workers=self.num_local_io_workers,
                            pin_memory=self.pin_memory, **options)  # fmt: skip
        self._batches = iter(loader)
        return self

    def __next__(self):
        if self._batches is None:
            iter(self)
        if self.tput_timer is not None:
            self.tput_timer.start_at_fetch()
        try:
            batch = next(self._batches)
        except StopIteration:
            if self.tput_timer is not None:
                self.tput_timer.discard()
            raise
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, self.data_sampler.state_dict())
        return batch

    def state_dict(self) -> dict:
        return self.data_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data_sampler.load_state_dict(state)
        self._batches = None  # the next batch comes from the restored sampler
