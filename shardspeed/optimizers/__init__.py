"""Optimizers PyTorch does not ship, written in pure PyTorch: `Lamb` (DeepSpeed's FusedLamb semantics) and
`Lion` (the Lion paper). DeepSpeed-named wrappers live in `shardspeed.ops`."""

from shardspeed.optimizers.lamb import Lamb
from shardspeed.optimizers.lion import Lion

__all__ = ["Lamb", "Lion"]
