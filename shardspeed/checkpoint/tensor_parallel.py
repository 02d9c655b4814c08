"""Tensor-parallel checkpoints: each tensor rank's files, and loading at another tensor degree.

Every tensor rank t writes DeepSpeed's `mp_rank_{t:02d}_model_states.pt` (from its data-parallel rank 0) and,
under ZeRO, `zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt`; the model-states file records
`mp_world_size` and `tp_partitions` (how each sharded parameter is split: dimension and fused segments).

`TensorParallelReader` presents a checkpoint saved at tensor degree T to an engine at degree T' (1 included,
or no engine: whole parameters, for consolidation, and for ds_to_universal; `cutting` presents a universal
folder's whole parameters to a tensor rank)
with the interface of `CheckpointReader`: each value (fp32 weight, per-element optimizer state) is merged
from the T files by its saved partition, then cut to this rank's shard by the model's current partition.
Resharding through it works for every ZeRO stage the optimizer wrappers can load from.

`TensorParallelState` is the checkpoint part recording the tensor layout (`mp_world_size`, `mp_rank`,
`tp_partitions`). Functions here take `tp`, the engine's tensor-parallel part (runtime/tensor_parallel.py:
`rank`, `size`, `partitions`), or None without tensor parallelism.
"""

from __future__ import annotations

import torch

from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.named_values import NamedParameters
from shardspeed.checkpoint.parts import Part, SaveOptions
from shardspeed.checkpoint.readers import open_checkpoint
from shardspeed.checkpoint.universal import CheckpointReader
from shardspeed.module_inject.layers import TPPartition, gather_shards, shard_tensor

__all__ = [
    "TensorParallelReader",
    "TensorParallelState",
    "mp_rank",
    "mp_world_size",
    "open_reader",
    "saved_partitions",
    "translate_shapes",
    "whole_model_states",
]


def open_reader(checkpoint_dir, tag=None):
    """A reader of whole parameters: `CheckpointReader`, or a merging one for a tensor-parallel checkpoint."""
    reader = open_checkpoint(checkpoint_dir, tag)  # ours or DeepSpeed's
    if isinstance(reader, CheckpointReader) and int(reader._model.get("mp_world_size", 1)) > 1:
        return TensorParallelReader(reader.path, reader._model, None)
    return reader


def whole_model_states(state: dict) -> dict:
    """A tensor-parallel model-states file as one describing the whole parameters (what ds_to_universal writes
    beside the merged values): full shapes, one model-parallel file, no partitions. The AutoTP layout stays in
    `universal_checkpoint_info` for DeepSpeed's loader."""
    if not isinstance(state.get("param_shapes"), dict) or "tp_partitions" not in state:
        raise CheckpointError(
            f"ds_to_universal: a tensor-parallel checkpoint (mp_world_size {state.get('mp_world_size')}) without "
            "shardspeed's recorded tp_partitions (DeepSpeed's own AutoTP files) cannot be merged into whole values"
        )
    saved = saved_partitions(state)
    whole = {k: v for k, v in state.items() if k not in ("tp_partitions", "mp_rank")}
    whole["param_shapes"] = {
        n: torch.Size(_full_shape(tuple(s), saved.get(n))) for n, s in state["param_shapes"].items()
    }
    whole["mp_world_size"] = 1
    return whole


def mp_rank(tp) -> int:
    return tp.rank if tp is not None else 0


def mp_world_size(tp) -> int:
    return tp.size if tp is not None else 1


def _current_partitions(tp) -> dict[str, TPPartition]:
    return dict(tp.partitions) if tp is not None else {}


class TensorParallelState(Part):
    """The tensor layout this rank saved with: recorded, read back by the model part when it loads (a
    checkpoint of another degree is merged and re-split). `files` overrides `mp_world_size`, the number of
    model-states files (the pipeline engine writes one per stage)."""

    name = "tensor_parallel"
    keys = ("mp_world_size", "mp_rank", "tp_partitions", "universal_checkpoint_info")
    optional = True

    def __init__(self, tp, files: int | None = None):
        self.tp = tp
        self.files = files

    def state_dict(self, options: SaveOptions) -> dict:
        state = {
            "mp_world_size": self.files if self.files is not None else mp_world_size(self.tp),
            "mp_rank": mp_rank(self.tp),
            "tp_partitions": {n: p.as_dict() for n, p in _current_partitions(self.tp).items()},
        }
        info = getattr(self.tp, "universal_info", None)
        if info is not None:  # DeepSpeed's engine writes the AutoTP layout for ds_to_universal
            state["universal_checkpoint_info"] = info
        return state


def saved_partitions(state: dict) -> dict[str, TPPartition]:
    return {
        name: TPPartition(int(p["dim"]), tuple(p["segments"]), int(p["tp_size"]))
        for name, p in (state.get("tp_partitions") or {}).items()
    }


def _local_shape(full: tuple, part: TPPartition | None) -> tuple:
    if part is None:
        return tuple(full)
    shape = list(full)
    shape[part.dim] //= part.tp_size
    return tuple(shape)


def _full_shape(local: tuple, part: TPPartition | None) -> tuple:
    if part is None:
        return tuple(local)
    shape = list(local)
    shape[part.dim] *= part.tp_size
    return tuple(shape)


def translate_shapes(state: dict, tp) -> dict[str, tuple]:
    """The checkpoint's recorded parameter shapes as this tensor rank would hold them."""
    saved, current = saved_partitions(state), _current_partitions(tp)
    return {
        n: _local_shape(_full_shape(tuple(s), saved.get(n)), current.get(n))
        for n, s in state["param_shapes"].items()
    }


def needs_tp_reshard(state: dict, tp) -> bool:
    return int(state.get("mp_world_size", 1)) != mp_world_size(tp)


class TensorParallelReader(NamedParameters):
    """A checkpoint of tensor degree T read by name in the tensor layout `tp` (see module docstring).
    `param_names` (NamedParameters) lists them, so ds_to_universal converts it like any checkpoint."""

    def __init__(self, path, model_states: dict, tp=None):
        self.saved_tp = int(model_states.get("mp_world_size", 1))
        self.readers = [CheckpointReader(path, mp_rank=t) for t in range(self.saved_tp)]
        first = self.readers[0]
        self.path, self.zero_stage, self.world_size = first.path, first.zero_stage, first.world_size
        self.saved = saved_partitions(model_states)
        self.current = _current_partitions(tp)
        self.rank = mp_rank(tp)
        self._shapes = translate_shapes(model_states, tp)

    @classmethod
    def cutting(cls, reader, tp) -> TensorParallelReader:
        """`reader`'s whole parameters (a universal folder's) presented as tensor rank `tp.rank`'s shards."""
        self = cls.__new__(cls)
        self.saved_tp, self.readers, self.saved = 1, [reader], {}
        self.path, self.zero_stage, self.world_size = reader.path, reader.zero_stage, reader.world_size
        self.current, self.rank = _current_partitions(tp), mp_rank(tp)
        self._shapes = {
            n: _local_shape(tuple(s), self.current.get(n)) for n, s in reader.param_shapes().items()
        }
        return self

    # -- the CheckpointReader interface the loaders use ---------------------------------------------------

    def param_shapes(self) -> dict[str, torch.Size]:
        return {n: torch.Size(s) for n, s in self._shapes.items()}

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._shapes[name])

    def frozen_param_names(self) -> list[str]:
        return self.readers[0].frozen_param_names()

    def shared_params(self) -> dict[str, str]:
        return self.readers[0].shared_params()

    def buffer_names(self) -> list[str]:
        return self.readers[0].buffer_names()

    def buffer(self, name: str) -> torch.Tensor:
        return self.readers[0].buffer(name)

    def state_dict_keys(self) -> list[str]:
        return self.readers[0].state_dict_keys()

    def has_value(self, name: str) -> bool:
        return self.readers[0].has_value(name)

    @property
    def has_optimizer_state(self) -> bool:
        return self.readers[0].has_optimizer_state

    def param_group_of(self, name: str):
        return self.readers[0].param_group_of(name)

    def param_groups(self) -> list[dict]:
        return self.readers[0].param_groups()

    def loss_scaler(self):
        return self.readers[0].loss_scaler()

    def buffers(self) -> dict[str, torch.Tensor]:
        return self.readers[0].buffers()

    def _relayout(self, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Merge the saved shards of `name`, then take this rank's shard of the current layout."""
        saved = self.saved.get(name)
        full = gather_shards(pieces, saved) if saved is not None else pieces[0]
        current = self.current.get(name)
        return shard_tensor(full, current, self.rank).contiguous() if current is not None else full

    def fp32(self, name: str) -> torch.Tensor:
        count = self.saved_tp if name in self.saved else 1
        return self._relayout(name, [r.fp32(name) for r in self.readers[:count]])

    def fp32_slice(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self.fp32(name).reshape(-1)[lo:hi].clone()

    def optimizer_state(self, name: str) -> dict:
        count = self.saved_tp if name in self.saved else 1
        states = [r.optimizer_state(name) for r in self.readers[:count]]
        shape = self.readers[0].shape(name)
        out = {}
        for key, value in states[0].items():
            if torch.is_tensor(value) and key != "step" and tuple(value.shape) == tuple(shape):
                out[key] = self._relayout(name, [s[key] for s in states])
            else:
                out[key] = value
        return out

    def optimizer_state_slice(self, name: str, lo: int, hi: int) -> tuple[dict, dict]:
        elements, scalars = {}, {}
        for key, value in self.optimizer_state(name).items():
            if torch.is_tensor(value) and key != "step" and value.dim() > 0 and value.numel() > 1:
                elements[key] = value.reshape(-1)[lo:hi].clone()
            else:
                scalars[key] = value
        return elements, scalars
