"""Read any checkpoint (ZeRO stage 0-3, any world size, fp32/fp16/bf16) by parameter name.

`CheckpointReader` hides how a checkpoint was sharded: it answers "the fp32 value of `blocks.0.mlp.0.weight`"
or "elements [lo, hi) of its `exp_avg`" by locating the pieces in the per-rank files. It is what resharding
(`load_universal` on the optimizer wrappers) and consolidation (consolidate.py) are built on.

[Note: lazy checkpoint reads] Every file is opened with `torch.load(mmap=True, weights_only=True)`: tensors
stay backed by the file, and only the bytes of the slices actually copied are read from disk (page cache,
which the OS can drop). The reader keeps the per-rank files' *mappings* open, never their contents: the
memory a caller pays for is the pieces it asks for — at most one full parameter for `fp32(name)`, or one
slice for `fp32_slice`. No process group is needed.

Where a value lives, by saved stage:
- stage 0: `module` (full parameters in the training dtype), `optimizer.fp32_master_weights` (mixed
  precision), `optimizer.optimizer_state_dict` (torch state keyed by index, named by `param_names`);
- stages 1-3: rank r's file holds, per bucket, elements `[r * shard_numel, (r + 1) * shard_numel)` of the
  padded flat buffer (fp32 masters and per-element optimizer state); stage 3 frozen parameters likewise in
  `frozen_shards`; stages 1-2 frozen parameters are full in `module`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.named_values import SlicedValues, numel

__all__ = ["CheckpointReader", "resolve_tag_dir"]


def resolve_tag_dir(checkpoint_dir, tag=None) -> Path:
    """The folder of one checkpoint: `<checkpoint_dir>/<tag>`, the tag read from `latest` when None.

    A tag folder itself (one holding the model-states file) is accepted too.
    """
    root = Path(checkpoint_dir)
    if tag is None:
        if (root / files.model_states_name()).is_file():
            return root
        if not root.is_dir():
            raise CheckpointError(f"checkpoint folder {root} does not exist")
        tag = files.read_latest(root)
        if tag is None:
            raise CheckpointError(
                f"{root} has no '{files.LATEST}' file naming the newest checkpoint: pass tag= (one of "
                f"{sorted(p.name for p in root.iterdir() if p.is_dir())})"
            )
    path = files.tag_folder(root, str(tag))
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return path


def _load_mapped(path: Path) -> dict:
    return files.read_checkpoint(path, mmap=True)


class CheckpointReader(SlicedValues):
    """A checkpoint presented by parameter name, whatever stage and world size wrote it.

    `model_states` may pass the already loaded model-states file (the engine has read it) to skip a re-read.
    """

    def __init__(self, checkpoint_dir, tag=None, *, model_states: dict | None = None, mp_rank: int = 0):
        self.path = resolve_tag_dir(checkpoint_dir, tag)
        self.mp_rank = mp_rank  # tensor rank whose files this reader reads (checkpoint/tensor_parallel.py)
        self._model = (
            model_states
            if model_states is not None
            else _load_mapped(self.path / files.model_states_name(mp_rank))
        )
        if "param_shapes" not in self._model:
            raise CheckpointError(
                f"{self.path / files.model_states_name()} has no 'param_shapes': not a shardspeed checkpoint"
            )
        if "moe_layout" in self._model:  # experts and optimizer state are in MoE files (moe/checkpoint.py)
            raise CheckpointError(
                f"{self.path} is a checkpoint of a model with MoE layers: it loads into an engine with the same MoE "
                "layers (at any ep size, world size or ZeRO stage) and shardspeed-to-deepspeed writes it in "
                "DeepSpeed's layout; consolidating it and converting it to a universal folder are not built"
            )
        self.zero_stage = int(self._model.get("zero_stage", 0))
        self.world_size = int(self._model.get("dp_world_size", 1))
        self._shapes = {n: torch.Size(s) for n, s in self._model["param_shapes"].items()}
        self._module = self._model.get("module") or {}
        # `buffer_names` lists non-persistent buffers too; only those in the state dict were saved.
        self._buffer_names = {n: None for n in self._model.get("buffer_names", []) if n in self._module}
        self._rank_files: dict[int, dict] = {}
        # name -> (bucket index, index in bucket), for trainable (`_locations`) and stage 3 frozen parameters.
        self._locations: dict[str, tuple[int, int]] = {}
        self._frozen_locations: dict[str, tuple[int, int]] = {}
        self._layouts: list[dict] = []
        self._frozen_layouts: list[dict] = []
        self._stage0_states: dict[str, dict] = {}
        self._masters: dict[str, torch.Tensor] = {}
        self._group_of: dict[str, int] = {}
        self._groups: list[dict] = []
        self._scaler: dict | None = None
        if self.zero_stage == 0:
            self._index_stage0()
        else:
            self._index_partitions()

    # -- indexing ------------------------------------------------------------------------------------------

    def _index_stage0(self) -> None:
        saved = self._model.get("optimizer")
        if not saved:
            return
        inner = saved["optimizer_state_dict"]
        self._masters = saved.get("fp32_master_weights") or {}
        for gi, (group, names) in enumerate(zip(inner["param_groups"], saved["param_names"])):
            for index, name in zip(group["params"], names):
                if name is not None:
                    self._group_of[name] = gi
                    self._stage0_states[name] = inner["state"].get(index, {})
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        self._scaler = saved.get("loss_scaler")

    def _rank_path(self, rank: int) -> Path:
        return self.path / files.zero_optim_states_name(rank, self.mp_rank)

    def _index_partitions(self) -> None:
        missing = [r for r in range(self.world_size) if not self._rank_path(r).is_file()]
        if missing:
            names = ", ".join(files.zero_optim_states_name(r) for r in missing)
            raise CheckpointError(
                f"checkpoint {self.path} is incomplete: it was saved by {self.world_size} data-parallel ranks "
                f"at ZeRO stage {self.zero_stage}, but the partition of rank(s) {missing} ({names}) is missing"
            )
        first = self._rank_file(0)
        self._layouts, self._frozen_layouts = first["buckets"], first.get("frozen_buckets", [])
        for layouts, locations in (
            (self._layouts, self._locations),
            (self._frozen_layouts, self._frozen_locations),
        ):
            for b, layout in enumerate(layouts):
                self._check_layout(layout, b)
                for i, name in enumerate(layout["names"]):
                    locations[name] = (b, i)
                    if layout.get("group") is not None:
                        self._group_of[name] = layout["group"]
        self._groups = first["param_groups"]
        self._scaler = first.get("loss_scaler")

    def _check_layout(self, layout: dict, index: int) -> None:
        where = f"{self._rank_path(0)}, bucket {index}"
        numels = [numel(s) for s in layout["shapes"]]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        if list(layout["offsets"]) != offsets or layout["numel"] != sum(numels):
            raise CheckpointError(
                f"inconsistent partition layout in {where}: offsets do not match the shapes"
            )
        if layout["shard_numel"] != -(-layout["numel"] // self.world_size):
            raise CheckpointError(
                f"inconsistent partition layout in {where}: shard of {layout['shard_numel']} elements for "
                f"{layout['numel']} elements over {self.world_size} ranks"
            )
        for name, shape in zip(layout["names"], layout["shapes"]):
            if name not in self._shapes or tuple(self._shapes[name]) != tuple(shape):
                raise CheckpointError(
                    f"inconsistent checkpoint {self.path}: {where} holds {name!r} of shape {tuple(shape)}, but "
                    f"the model-states file lists {tuple(self._shapes.get(name, ())) or 'no such parameter'}"
                )

    def check_rank_file(self, rank: int) -> None:
        """Read rank `rank`'s partition file and check it against the model-states file (CheckpointError)."""
        self._rank_file(rank)

    def _rank_file(self, rank: int) -> dict:
        """Rank `rank`'s partition, memory-mapped and checked against rank 0's layout (cached)."""
        if rank in self._rank_files:
            return self._rank_files[rank]
        path = self._rank_path(rank)
        outer = _load_mapped(path)
        state = outer.get("optimizer_state_dict") if isinstance(outer, dict) else None
        if not isinstance(state, dict) or "buckets" not in state:
            raise CheckpointError(f"{path} is not a ZeRO partition file (no optimizer_state_dict/buckets)")
        problems = []
        if state.get("world_size") != self.world_size or state.get("rank") != rank:
            problems.append(
                f"it says rank {state.get('rank')} of {state.get('world_size')}, expected rank {rank} of "
                f"{self.world_size}"
            )
        if state.get("zero_stage") != self.zero_stage:
            problems.append(
                f"ZeRO stage {state.get('zero_stage')}, the model-states file says {self.zero_stage}"
            )
        if rank > 0 and (
            state["buckets"] != self._layouts or state.get("frozen_buckets", []) != self._frozen_layouts
        ):
            problems.append(f"its partition layout differs from {files.zero_optim_states_name(0)}'s")
        for key, layouts in (
            ("fp32_shards", state["buckets"]),
            ("frozen_shards", state.get("frozen_buckets", [])),
        ):
            shards = state.get(key, [])
            if len(shards) != len(layouts) or any(
                s.numel() != layout["shard_numel"] for s, layout in zip(shards, layouts)
            ):
                problems.append(f"its {key} do not match its layout")
        if problems:
            raise CheckpointError(f"inconsistent checkpoint partition {path}: " + "; ".join(problems))
        self._rank_files[rank] = state
        return state

    # -- what the checkpoint holds --------------------------------------------------------------------------

    def frozen_param_names(self) -> list[str]:
        return list(self._model.get("frozen_param_names", []))

    def shared_params(self) -> dict[str, str]:
        """Tied weights: {alias state-dict key: name of the parameter holding the data}."""
        return dict(self._model.get("shared_params", {}))

    def buffer_names(self) -> list[str]:
        """Persistent buffers saved in the checkpoint, in the model's order."""
        return list(self._buffer_names)

    def buffer(self, name: str) -> torch.Tensor:
        """A saved buffer, memory-mapped (clone it to keep it)."""
        return self._module[name]

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: self._module[n].clone() for n in self.buffer_names()}

    def state_dict_keys(self) -> list[str]:
        """Every key of the model's state dict that the checkpoint can produce (tied aliases included)."""
        shared = self.shared_params()
        known = [*self._shapes, *shared, *self.buffer_names()]
        # The module's own order where it has the key (stages 0-2), then whatever it lacks (stage 3 parameters).
        wanted = set(known)
        keys = dict.fromkeys([k for k in self._module if k in wanted] + known)
        return [k for k in keys if self.has_value(shared.get(k, k))]

    def has_value(self, name: str) -> bool:
        """Whether the checkpoint holds `name`'s value (frozen ones may be excluded at save)."""
        if name in self._buffer_names:
            return True
        return name in self._locations or name in self._frozen_locations or name in self._module

    @property
    def has_optimizer_state(self) -> bool:
        return bool(self._groups)

    def param_group_of(self, name: str) -> int | None:
        """The optimizer group index of `name` when saved, or None (frozen / not in the optimizer)."""
        return self._group_of.get(name)

    def param_groups(self) -> list[dict]:
        """Each optimizer group's hyper-parameters (no "params"), in group order."""
        return copy.deepcopy(self._groups)

    def loss_scaler(self) -> dict | None:
        """The fp16 loss scaler's state, or None when the checkpoint did not train with fp16 loss scaling."""
        fp16 = (self._model.get("ds_config") or {}).get("fp16") or {}
        return dict(self._scaler) if self._scaler and fp16.get("enabled") is True else None

    # -- values ---------------------------------------------------------------------------------------------

    def _slice(self, name: str, lo: int, hi: int) -> torch.Tensor:
        self._check_name(name)
        if name in self._locations:
            return self._gather(self._layouts, self._locations[name], lo, hi, "fp32_shards")
        if name in self._frozen_locations:
            return self._gather(self._frozen_layouts, self._frozen_locations[name], lo, hi, "frozen_shards")
        source = self._masters.get(name)
        if source is None:
            source = self._module.get(name)
        if source is None:
            raise CheckpointError(
                f"checkpoint {self.path} holds no value for parameter {name!r} (saved with "
                "exclude_frozen_parameters?)"
            )
        return source.reshape(-1)[lo:hi].clone()

    def _gather(
        self, layouts, location, lo: int, hi: int, key: str, state_key: str | None = None
    ) -> torch.Tensor:
        """Copy elements [lo, hi) of a parameter out of every rank's shard that holds some of them."""
        bucket, index = location
        layout = layouts[bucket]
        shard = layout["shard_numel"]
        start, end = layout["offsets"][index] + lo, layout["offsets"][index] + hi
        if end <= start:
            return torch.empty(0)
        pieces = []
        for rank in range(start // shard, -(-end // shard)):
            held = self._rank_file(rank)[key][bucket]
            if state_key is not None:
                if state_key not in held:
                    raise CheckpointError(
                        f"inconsistent checkpoint partition {self._rank_path(rank)}: bucket {bucket} has no "
                        f"optimizer state {state_key!r} while another rank's has"
                    )
                held = held[state_key]
            a, z = max(start, rank * shard), min(end, (rank + 1) * shard)
            pieces.append(held[a - rank * shard : z - rank * shard])
        if not pieces:
            return torch.empty(0)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()

    # -- optimizer state --------------------------------------------------------------------------------------

    def optimizer_state(self, name: str) -> dict:
        """`name`'s optimizer state: per-element tensors (e.g. exp_avg) full and parameter-shaped, scalar
        state (e.g. step) copied. Empty when the checkpoint has none for it."""
        elements, scalars = self.optimizer_state_slice(name, 0, numel(self.shape(name)))
        return {**scalars, **{k: v.view(self._shapes[name]) for k, v in elements.items()}}

    def optimizer_state_slice(self, name: str, lo: int, hi: int) -> tuple[dict, dict]:
        """Elements [lo, hi) of `name`'s per-element optimizer state as 1-D tensors, and its scalar state."""
        self._check_name(name)
        if name in self._locations:
            return self._partitioned_state(name, lo, hi)
        state = self._stage0_states.get(name, {})
        shape = tuple(self._shapes[name])
        elements, scalars = {}, {}
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step" and tuple(value.shape) == shape:
                elements[key] = value.reshape(-1)[lo:hi].clone()
            else:
                scalars[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
        return elements, scalars

    def _partitioned_state(self, name: str, lo: int, hi: int) -> tuple[dict, dict]:
        bucket, index = self._locations[name]
        layout = self._layouts[bucket]
        shard = layout["shard_numel"]
        count = numel(self._shapes[name])
        # Scalar state and the list of keys come from the rank holding the parameter's first wanted element.
        first = layout["offsets"][index] + min(lo, max(count - 1, 0))
        held = self._rank_file(first // shard if shard else 0)["optimizer_states"][bucket]
        elements, scalars = {}, {}
        for key, value in held.items():
            if torch.is_tensor(value) and key != "step" and value.dim() == 1 and value.numel() == shard:
                elements[key] = self._gather(
                    self._layouts, (bucket, index), lo, hi, "optimizer_states", state_key=key
                )
            else:
                scalars[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
        return elements, scalars


# -- helpers the optimizer wrappers share when loading from a reader ----------------------------------------


def load_group_hyperparameters(reader: CheckpointReader, param_groups: list[dict], group_of: dict) -> None:
    """Restore each optimizer group's hyper-parameters (lr, betas, ...) by group index.

    `group_of` maps the parameter names of this optimizer to their group; a parameter saved in another
    group means the grouping changed, and the hyper-parameters would land on the wrong parameters.
    """
    saved = reader.param_groups()
    if len(saved) != len(param_groups):
        raise CheckpointError(
            f"checkpoint {reader.path} has {len(saved)} optimizer parameter groups, this optimizer has "
            f"{len(param_groups)}"
        )
    moved = [
        f"{name!r} (group {reader.param_group_of(name)} -> {gi})"
        for name, gi in group_of.items()
        if reader.param_group_of(name) not in (None, gi)
    ]
    if moved:
        raise CheckpointError(
            f"checkpoint {reader.path} groups parameters differently from this optimizer: {', '.join(moved[:6])}"
        )
    for group, hyper in zip(param_groups, saved):
        group.update(hyper)


def restore_loss_scaler(reader: CheckpointReader, scaler) -> None:
    """Carry the fp16 loss scale over only from an fp16 run into an fp16 run (bf16/fp32 have no scale)."""
    from shardspeed.core.precision import NoScaler

    saved = reader.loss_scaler()
    if saved is not None and not isinstance(scaler, NoScaler):
        scaler.load_state_dict(saved)
