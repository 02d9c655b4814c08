"""`RngStates`: each rank's random-number streams, in its own `rng_states_rank_<R>.pt` (for bit-exact resume).

The part writes this rank's torch, CUDA, Python and NumPy generator states into the tag folder and restores
them on load when the file of this rank is there (a checkpoint saved at another world size has none for
some ranks: their streams are left as they are, which is logged). `after_relayout=False` leaves the streams
alone whenever an earlier part loaded across a layout change (the pipeline engine's rule).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist

from shardspeed.checkpoint import files
from shardspeed.checkpoint.parts import LoadContext, Part, SaveOptions
from shardspeed.utils.logging import log_dist

__all__ = ["RngStates", "rng_state", "set_rng_state"]


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_tuples(obj):
    # weights-only loading gives lists where Python's generator state has tuples
    return tuple(_as_tuples(o) for o in obj) if isinstance(obj, (list, tuple)) else obj


class RngStates(Part):
    name = "rng"

    def __init__(self, after_relayout: bool = True):
        self.after_relayout = after_relayout

    def write_files(self, staging: Path, options: SaveOptions) -> None:
        files.save_file(rng_state(), staging / files.rng_states_name(dist.get_rank()))

    def load_state_dict(self, entries: dict, ctx: LoadContext) -> None:
        if ctx.resharded and not self.after_relayout:
            return
        rng_file = ctx.path / files.rng_states_name(dist.get_rank())
        if rng_file.is_file():
            set_rng_state(files.load_file(rng_file))
        elif self.after_relayout:
            log_dist(
                f"{rng_file.name} not in checkpoint (saved at another world size, or by DeepSpeed, which saves "
                "no RNG states): RNG streams not restored"
            )
