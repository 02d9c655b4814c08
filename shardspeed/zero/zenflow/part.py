"""`ZenFlowState`: ZenFlow's own state in a checkpoint, one `zenflow_rank_<R>.pt` per rank.

What it holds is per rank and not in the optimizer files: the schedule's counters, the selected columns, the
selective optimizer's moments and this rank's shard of the gradient accumulated for the host optimizer, so
that a run resumed in the middle of an update window continues exactly. It is restored with the optimizer
states (not with `load_optimizer_states=False` or `load_module_only`), and only at the world size it was saved
at (the accumulator is a shard): after a reshard, or from a checkpoint without the file, ZenFlow starts afresh
with a new selection, which is logged.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from shardspeed.checkpoint import files
from shardspeed.checkpoint.parts import LoadContext, Part, SaveOptions
from shardspeed.utils.logging import log_dist

__all__ = ["ZenFlowState", "zenflow_parts"]


def _file_name(rank: int) -> str:
    return f"zenflow_rank_{rank}.pt"


class ZenFlowState(Part):
    name = "zenflow"
    optional = True

    def __init__(self, optimizer):
        self.optimizer = optimizer  # a ZenFlowZeroOptimizer

    def write_files(self, staging: Path, options: SaveOptions) -> None:
        files.save_file(self.optimizer.zenflow_state_dict(), staging / _file_name(dist.get_rank()))

    def load_state_dict(self, entries: dict, ctx: LoadContext) -> None:
        if not ctx.options.optimizer:
            return
        path = ctx.path / _file_name(dist.get_rank())
        if ctx.resharded or not path.is_file():
            log_dist(f"{path.name} not restored (absent, or saved at another layout): ZenFlow selects afresh")
            self.optimizer.start_afresh()
            return
        self.optimizer.load_zenflow_state_dict(files.load_file(path))


def zenflow_parts(optimizer) -> list:
    """The checkpoint part of a ZenFlow optimizer wrapper; none for any other wrapper."""
    return [ZenFlowState(optimizer)] if hasattr(optimizer, "zenflow_state_dict") else []
