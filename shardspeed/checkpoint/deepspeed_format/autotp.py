"""DeepSpeed's own ZeRO 0-2 AutoTP checkpoints read as whole parameters, for `ds_to_universal`.

DeepSpeed 0.19.8 with `tensor_parallel.autotp_size` T writes one set of files per tensor rank t
(`mp_rank_{t:02d}_model_states.pt`, `zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt`), each holding rank t's
shards under the parameters' names, and no record of how each was split beyond the model's
`universal_checkpoint_info` (pattern lists and fused-part widths). `DeepSpeedAutoTPReader` opens every tensor
rank's files with `DeepSpeedCheckpointReader` and merges each value — the fp32 master and every per-element
optimizer state — by that info (checkpoint/tp_slices.py), presenting the whole checkpoint with the reader
interface `write_universal` reads.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from shardspeed.checkpoint.deepspeed_format.read import (
    DeepSpeedCheckpointReader,
    model_states_path,
    read_file,
)
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.tp_slices import merge_rank_slices

__all__ = ["DeepSpeedAutoTPReader"]

_INFO = "universal_checkpoint_info"


class DeepSpeedAutoTPReader:
    """Whole values of a DeepSpeed AutoTP checkpoint (tensor degree `mp_world_size` of rank 0's file)."""

    def __init__(self, tag_dir, model_states: dict):
        self.tp = int(model_states.get("mp_world_size") or 1)
        self.info = model_states.get(_INFO)
        if not self.info:
            raise CheckpointError(
                f"{model_states_path(tag_dir)} has no '{_INFO}': its tensor slices cannot be merged"
            )
        states = [model_states] + [
            read_file(model_states_path(tag_dir, t), mmap=True) for t in range(1, self.tp)
        ]
        self.ranks = [
            DeepSpeedCheckpointReader(tag_dir, model_states=s, mp_rank=t) for t, s in enumerate(states)
        ]
        self.path = self.ranks[0].path
        self._whole_shape = lru_cache(maxsize=None)(lambda name: tuple(self.fp32(name).shape))

    def __getattr__(self, name: str):
        # names, groups, hyper-parameters, the loss scaler, buffers: the same in every tensor rank's files
        return getattr(self.ranks[0], name)

    def _merge(self, name: str, values: list) -> torch.Tensor:
        return merge_rank_slices(self.info, name, values, self.tp)[0]

    def fp32(self, name: str) -> torch.Tensor:
        return self._merge(name, [r.fp32(name) for r in self.ranks])

    def shape(self, name: str) -> tuple:
        return self._whole_shape(name)

    def optimizer_state(self, name: str) -> dict:
        per_rank = [r.optimizer_state(name) for r in self.ranks]
        merged = {}
        for key, value in per_rank[0].items():
            if torch.is_tensor(value) and value.dim() > 0:  # per element: merged like the parameter
                merged[key] = self._merge(
                    name, [s[key].reshape(r.shape(name)) for s, r in zip(per_rank, self.ranks)]
                )
            else:  # the step: one value for all
                merged[key] = value
        return merged

    def whole_model_states(self) -> dict:
        """Rank 0's model-states file describing whole parameters (the universal folder keeps it beside): whole
        `param_shapes`, one tensor rank, and of `module` only the buffers (whole on every rank)."""
        state = dict(self.ranks[0]._raw)
        shapes = state.get("param_shapes")
        if isinstance(shapes, list):
            state["param_shapes"] = [{n: torch.Size(self.shape(n)) for n in group} for group in shapes]
        buffers = set(self.ranks[0].buffer_names())
        state["module"] = {k: v for k, v in (state.get("module") or {}).items() if k in buffers}
        state["mp_world_size"] = 1
        return state
