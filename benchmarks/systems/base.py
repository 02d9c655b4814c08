"""What every system module provides: a `Trainer` built from the model, and how to say "can't run this"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.models import Hyper, ModelSpec


class SystemUnavailable(Exception):
    """Raised in every rank of a job when a system cannot run here (not installed, not implemented yet)."""


@dataclass
class BuildContext:
    """What a system's `build` gets: the model (already built from the seed) and the run's settings."""

    model: nn.Module
    spec: ModelSpec
    hyper: Hyper
    micro_batch: int
    world_size: int
    zero_stage: int
    reduce_bucket_size: int | None = None  # None: each engine's default


@dataclass
class Trainer:
    """One training step split in two, so the harness can count model states while gradients exist.

    `backward(batch)` runs forward and backward and returns the loss; `step()` applies the optimizer and
    clears gradients. `state_roots` are the objects holding the model states (walked by
    measure.model_state_bytes); `hidden_state_bytes` adds what lives outside Python (DDP's C++ buckets).
    """

    backward: Callable[[torch.Tensor], torch.Tensor]
    step: Callable[[], None]
    state_roots: list = field(default_factory=list)
    hidden_state_bytes: int = 0


@dataclass(frozen=True)
class System:
    """A row of the benchmark: `build` runs in each spawned rank; `zero_stage` picks the memory formula."""

    name: str
    family: str
    zero_stage: int
    world_size: int
    build: Callable[[BuildContext], Trainer]
    env: tuple[tuple[str, str], ...] = ()
    unavailable: Callable[[], str | None] = lambda: None  # checked in the parent before spawning
