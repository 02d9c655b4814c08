"""`DeepSpeedCheckpointReader`: a checkpoint written by DeepSpeed 0.19, presented by parameter name with the
interface of `CheckpointReader` (checkpoint/universal.py), so that resharding and consolidation read it as
they read ours.

What DeepSpeed 0.19 writes into a tag folder (DeepSpeed's names; D = data-parallel rank):
- `mp_rank_00_model_states.pt` (stages 0-2) or one `zero_pp_rank_<D>_mp_rank_00_model_states.pt` per rank
  (stage 3): `module` (the state dict; at stage 3 parameters are empty placeholders), `buffer_names`,
  `param_shapes` (a list of {name: shape}, one per flat buffer, in flat order; None at stage 0),
  `frozen_param_shapes`/`frozen_param_fragments` (stages 2-3), `shared_params`, `optimizer` (stage 0 only),
  `lr_scheduler`, `data_sampler`, `global_steps`, `global_samples`, `skipped_steps`, `dp_world_size`,
  `mp_world_size`, `ds_config`, `ds_version`, ... and the client's entries;
- stages 1-3: `[bf16_]zero_pp_rank_<D>_mp_rank_00_optim_states.pt`, whose `optimizer_state_dict` holds rank
  D's flat fp32 master slices and optimizer state (layout.py says where each parameter is in them).

Stage 0 keeps the torch optimizer's state dict in `optimizer` (fp32), or inside it under
`optimizer_state_dict` with the fp32 masters in `fp32_groups` (bf16/fp16). DeepSpeed records no parameter
names there: optimizer index k is the k-th parameter of the module (the order DeepSpeed's engine passes them
in); the count and every shape are checked.

DeepSpeed's `BF16_Optimizer` (a bf16 pipeline at ZeRO stage 0, or bf16 with fp32 gradient accumulation at
stage 1) writes `bf16_zero_pp_rank_<D>_mp_rank_XX_optim_states.pt` in the ZeRO-1 flat layout too, with three
differences: its `optimizer_state_dict` records no `zero_stage` and no `param_alignment_paddings`, and every
rank's fp32 slice keeps its end padding. Its `param_slice_mappings` (each parameter's start and size in the
rank's slice) are checked against the layout, as ZeRO-1/2's are.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format import layout as layouts
from shardspeed.checkpoint.deepspeed_format import pickled
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.named_values import SlicedValues, numel

__all__ = [
    "SUPPORTED_VERSIONS",
    "DeepSpeedCheckpointReader",
    "is_bf16_optimizer_state",
    "is_deepspeed_state",
    "model_states_path",
    "read_file",
]

SUPPORTED_VERSIONS = ("0.19.",)  # ds_version prefixes whose layout this module reads (0.19.8 verified)


def is_deepspeed_state(state) -> bool:
    """Whether a model-states dict was written by DeepSpeed (ours also records ds_version, and shardspeed's)."""
    return isinstance(state, dict) and "ds_version" in state and "shardspeed_version" not in state


def model_states_path(tag_dir: Path, mp_rank: int = 0) -> Path:
    """The model-states file to read: `mp_rank_XX_model_states.pt`, or DeepSpeed's stage-3 rank-0 one."""
    own = tag_dir / files.model_states_name(mp_rank)
    stage3 = tag_dir / f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"
    return stage3 if not own.is_file() and stage3.is_file() else own


def read_file(path: Path, mmap: bool = False) -> dict:
    """A DeepSpeed checkpoint file's content, read weights-only (pickled.py), or a CheckpointError naming it."""
    problem = files.diagnose(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint file {path} {problem}")
    try:
        content = pickled.load(path, mmap=mmap)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint file {path} could not be read (corrupt, or holds objects a safe load refuses: only "
            f"tensors, plain values and the DeepSpeed 0.19 objects of pickled.py are read, no pickled code runs): {err}"
        ) from err
    if not isinstance(content, dict):
        raise CheckpointError(
            f"checkpoint file {path} holds a {type(content).__name__}, not a checkpoint dict"
        )
    return content


def _check_version(path: Path, state: dict) -> str:
    version = state.get("ds_version")
    if not isinstance(version, str) or not version.startswith(SUPPORTED_VERSIONS):
        raise CheckpointError(
            f"{path} was written by DeepSpeed {version!r}; this version reads the checkpoint layout of "
            f"DeepSpeed {', '.join(v + 'x' for v in SUPPORTED_VERSIONS)} (convert it with that DeepSpeed's "
            "ds_to_universal, or load it with module weights only through a state dict)"
        )
    return version


def _refuse_moe(tag_dir: Path, path: Path, state: dict, mp_rank: int) -> None:
    """DeepSpeed's MoE layout (experts in `layer_<L>_expert_<E>_*` files, optimizer state in `expp_rank_*` or
    expert-parallel ZeRO partitions) is read by moe.py, for an engine with MoE layers; this reader (consolidation,
    a model without MoE layers) refuses it rather than read it without its experts."""
    if not state.get("num_experts"):
        return
    pattern = f"layer_*_expert_*_mp_rank_{mp_rank:02d}_model_states.pt"
    experts = sorted(p.name for p in tag_dir.glob(pattern))
    raise CheckpointError(
        f"{path} is a DeepSpeed MoE checkpoint (num_experts {state['num_experts']}; expert files {experts[:4]}): "
        "it is read only by an engine whose model has the same MoE layers (load_checkpoint); consolidating it or "
        "reading it by name is not offered by this version"
    )


def is_bf16_optimizer_state(osd) -> bool:
    """Whether an optimizer state dict is DeepSpeed's `BF16_Optimizer`'s (flat fp32 slices, no ZeRO stage)."""
    return (
        isinstance(osd, dict)
        and "single_partition_of_fp32_groups" in osd
        and "base_optimizer_state" in osd
        and "zero_stage" not in osd
    )


def _refuse_nvme_offload(tag_dir: Path) -> None:
    """With `offload_optimizer.device: nvme` DeepSpeed copies its swap folder into `offloaded_tensors/rank<R>/`:
    raw buffers named by its internal parameter ids, which its partition files do not replace. Not read here;
    refused rather than resumed without that state."""
    offloaded = tag_dir / "offloaded_tensors"
    if offloaded.exists():
        raise CheckpointError(
            f"{offloaded} holds DeepSpeed's NVMe-offloaded optimizer state (raw swap files named by DeepSpeed's "
            "internal parameter ids), which this version does not read"
        )


def _zero_stage(path: Path, state: dict) -> int:
    zero = (state.get("ds_config") or {}).get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, 1, 2, 3):
        raise CheckpointError(
            f"{path} records ds_config zero_optimization.stage = {stage!r}, not a ZeRO stage 0-3"
        )
    if zero.get("round_robin_gradients"):
        raise CheckpointError(
            f"{path} was saved with zero_optimization.round_robin_gradients, whose reordered flat layout this "
            "version does not read"
        )
    return int(stage)


class DeepSpeedCheckpointReader(SlicedValues):
    """A DeepSpeed 0.19 checkpoint (ZeRO stage 0-3, fp32/bf16/fp16) by parameter name.

    `tag_dir` is the tag folder; `model_states` may pass its already-read model-states dict."""

    def __init__(self, tag_dir, *, model_states: dict | None = None, mp_rank: int = 0):
        self.path = Path(tag_dir)
        self.mp_rank = mp_rank
        self._model_file = model_states_path(self.path, mp_rank)
        raw = model_states if model_states is not None else read_file(self._model_file, mmap=True)
        self.version = _check_version(self._model_file, raw)
        _refuse_moe(self.path, self._model_file, raw, mp_rank)
        _refuse_nvme_offload(self.path)
        self._raw = raw
        self.zero_stage = _zero_stage(self._model_file, raw)
        self.world_size = int(raw.get("dp_world_size") or 1)
        self._module = raw.get("module") or {}
        self._buffer_names = [n for n in raw.get("buffer_names") or [] if n in self._module]
        self._shared = dict(raw.get("shared_params") or {})
        self._frozen_shapes = {n: torch.Size(s) for n, s in (raw.get("frozen_param_shapes") or {}).items()}
        self._rank_files: dict[int, dict] = {}
        self._groups: list[dict] = []
        self._group_of: dict[str, int] = {}
        self._scaler: dict | None = None
        self._stage0_values: dict[str, torch.Tensor] = {}
        self._stage0_states: dict[str, dict] = {}
        self._layout = None
        # BF16_Optimizer's files (module docstring): ZeRO-1's flat layout whatever the configured stage
        self.bf16_optimizer = is_bf16_optimizer_state(raw.get("optimizer"))
        if self.zero_stage == 0 and not self.bf16_optimizer:
            self._shapes = self._module_param_shapes()
            self._index_stage0()
        else:
            self._index_partitions()

    @property
    def has_partition_files(self) -> bool:
        """Whether the optimizer state is in per-rank partition files (ZeRO 1-3, or BF16_Optimizer's)."""
        return self._layout is not None

    # -- indexing ------------------------------------------------------------------------------------------

    def _param_keys(self) -> list[str]:
        """The module's parameter keys in its order (buffers and tied aliases left out)."""
        skip = set(self._buffer_names) | set(self._shared)
        return [k for k in self._module if k not in skip]

    def _module_param_shapes(self) -> dict[str, torch.Size]:
        keys, seen, shapes = self._param_keys(), set(), {}
        for key in keys:  # stage 0 records no shared_params: a tied alias shares its storage with the first
            tensor = self._module[key]
            ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if tensor.numel() and ident in seen:
                self._shared.setdefault(key, next(n for n in shapes if self._same(n, tensor)))
                continue
            seen.add(ident)
            shapes[key] = tensor.shape
        return shapes

    def _same(self, name: str, tensor) -> bool:
        other = self._module[name]
        return other.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()

    def _index_stage0(self) -> None:
        saved = self._raw.get("optimizer")
        if not saved:
            return
        inner = saved.get("optimizer_state_dict", saved)
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise CheckpointError(f"{self._model_file}: its 'optimizer' entry is not an optimizer state dict")
        masters = saved.get("fp32_groups")  # mixed precision: one fp32 master per parameter, per group
        names = list(self._shapes)
        indices = [i for g in inner["param_groups"] for i in g["params"]]
        if len(indices) != len(names):
            raise CheckpointError(
                f"{self._model_file}: the optimizer holds {len(indices)} parameters, the module {len(names)}: "
                "DeepSpeed records no names at stage 0, so they cannot be matched"
            )
        flat_masters = [m for group in masters for m in group] if masters is not None else None
        for k, (index, name) in enumerate(zip(indices, names)):
            state = inner["state"].get(index, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != self._shapes[name]:
                    raise CheckpointError(
                        f"{self._model_file}: optimizer state {key!r} of index {index} has shape "
                        f"{tuple(value.shape)}, parameter {name!r} {tuple(self._shapes[name])}"
                    )
            self._stage0_states[name] = state
            if flat_masters is not None:
                self._stage0_values[name] = flat_masters[k]
        name_of = dict(zip(indices, names))
        for gi, group in enumerate(inner["param_groups"]):
            for index in group["params"]:
                self._group_of[name_of[index]] = gi
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        self._scaler = _scaler_of(saved)

    def _partition_path(self, rank: int) -> Path:
        bf16 = ((self._raw.get("ds_config") or {}).get("bf16") or {}).get("enabled") is True
        names = [f"{p}zero_pp_rank_{rank}_mp_rank_{self.mp_rank:02d}_optim_states.pt" for p in ("bf16_", "")]
        names = names if bf16 else names[::-1]
        found = [self.path / n for n in names if (self.path / n).is_file()]
        return found[0] if found else self.path / names[0]

    def _index_partitions(self) -> None:
        shapes = self._raw.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise CheckpointError(
                f"{self._model_file} has no 'param_shapes' list: not a DeepSpeed ZeRO stage {self.zero_stage} "
                "model-states file"
            )
        buffers = [[(n, tuple(s)) for n, s in g.items()] for g in shapes]
        missing = [self._partition_path(r).name for r in range(self.world_size)]
        missing = [n for r, n in enumerate(missing) if not self._partition_path(r).is_file()]
        if missing:
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.path} is incomplete: it was saved by {self.world_size} data-parallel "
                f"ranks at ZeRO stage {self.zero_stage}, but {', '.join(missing)} is missing"
            )
        first = self._optimizer_dict(0)
        self.bf16_optimizer = is_bf16_optimizer_state(first)
        if self.zero_stage == 3:
            self._layout = layouts.Zero3Layout(buffers, self.world_size)
            groups = first["optimizer_state_dict"]["param_groups"]
            owner = {s: gi for gi, g in enumerate(groups) for s in g["params"]}
        else:
            paddings = first.get("param_alignment_paddings") or []
            self._layout = layouts.Zero12Layout(buffers, paddings, self.world_size)
            groups = first["base_optimizer_state"]["param_groups"]
            owner = {g: g for g in range(len(buffers))}
        self._check_sizes(self._partition_path(0), 0, self._rank_files[0])  # read before the layout was known
        order = {n: i for i, n in enumerate(self._param_keys())}
        flat = {n: torch.Size(s) for g in buffers for n, s in g}
        self._shapes = {n: flat.get(n, self._frozen_shapes.get(n)) for n in sorted(order, key=order.get)}
        self._shapes.update(
            {n: s for n, s in {**flat, **self._frozen_shapes}.items() if n not in self._shapes}
        )
        unknown = [n for n, s in self._shapes.items() if s is None]
        if unknown:
            raise CheckpointError(f"{self._model_file}: no recorded shape for parameters {unknown[:6]}")
        for name in flat:
            self._group_of[name] = owner[self._layout.group_of(name)]
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._scaler = _scaler_of(first)

    def _optimizer_dict(self, rank: int) -> dict:
        return self._rank_file(rank)["optimizer"]

    def check_rank_file(self, rank: int) -> None:
        """Read rank `rank`'s partition file and check it against the layout (CheckpointError)."""
        self._rank_file(rank)

    def _rank_file(self, rank: int) -> dict:
        """Rank `rank`'s flat fp32 and optimizer-state buffers, memory-mapped and checked (cached)."""
        if rank in self._rank_files:
            return self._rank_files[rank]
        path = self._partition_path(rank)
        outer = read_file(path, mmap=True)
        _check_version(path, outer)
        osd = outer.get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise CheckpointError(
                f"{path} has no 'optimizer_state_dict': not a DeepSpeed ZeRO partition file"
            )
        stage = osd.get("zero_stage")
        if stage != self.zero_stage and not (is_bf16_optimizer_state(osd) and self.zero_stage < 2):
            raise CheckpointError(
                f"{path} says ZeRO stage {stage}, the checkpoint's config {self.zero_stage}"
            )
        if self._layout is not None and is_bf16_optimizer_state(osd) != self.bf16_optimizer:
            raise CheckpointError(
                f"{path} and the partition file of rank 0 were written by different optimizers"
            )
        if self.zero_stage == 3:
            fp32, base = osd.get("fp32_flat_groups"), osd.get("optimizer_state_dict")
            count = osd.get("partition_count")
        else:
            fp32, base = osd.get("single_partition_of_fp32_groups"), osd.get("base_optimizer_state")
            count = (osd.get("partition_count") or [None])[0]
            if isinstance(base, list):
                raise CheckpointError(
                    f"{path} is an elastic ZeRO checkpoint (zero_optimization.elastic_checkpoint), a layout this "
                    "version does not read"
                )
        if not isinstance(fp32, list) or not isinstance(base, dict) or "state" not in base:
            raise CheckpointError(
                f"{path}: its optimizer_state_dict lacks the flat fp32 groups or optimizer state"
            )
        if count != self.world_size:
            raise CheckpointError(
                f"{path} was partitioned over {count} ranks, the model-states file says {self.world_size}"
            )
        entry = {"optimizer": osd, "fp32": fp32, "state": base["state"]}
        if self._layout is not None:
            self._check_sizes(path, rank, entry)
        self._rank_files[rank] = entry
        return entry

    def _check_sizes(self, path: Path, rank: int, entry: dict) -> None:
        lay = self._layout
        if isinstance(lay, layouts.Zero3Layout):
            fp32_sizes, state_sizes = lay.buffer_numel, lay.buffer_numel
        elif self.bf16_optimizer:  # BF16_Optimizer keeps every rank's whole slice, end padding included
            fp32_sizes = state_sizes = lay.partition_numel
        else:
            fp32_sizes = [lay.expected_fp32_numel(rank, g) for g in range(len(lay.partition_numel))]
            state_sizes = lay.partition_numel
        got = [t.numel() for t in entry["fp32"]]
        if got != list(fp32_sizes):
            raise CheckpointError(
                f"{path} holds fp32 buffers of {got} elements, but the recorded parameter shapes give "
                f"{list(fp32_sizes)} for rank {rank} of {self.world_size}"
            )
        for index, size in enumerate(state_sizes):
            for key, value in entry["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.dim() == 1 and key != "step" and value.numel() != size:
                    raise CheckpointError(
                        f"{path}: optimizer state {key!r} of buffer {index} has {value.numel()} elements, "
                        f"expected {size}"
                    )
        if isinstance(lay, layouts.Zero12Layout):
            self._check_slice_mappings(path, rank, entry["optimizer"].get("param_slice_mappings"))

    def _check_slice_mappings(self, path: Path, rank: int, mappings) -> None:
        """DeepSpeed's own record of where each parameter's piece is in this rank's slices (ZeRO-1/2 and
        BF16_Optimizer files) must be where the layout computed from `param_shapes` puts it."""
        if not isinstance(mappings, list):
            return
        for group, mapping in enumerate(mappings):
            for name, address in (mapping or {}).items():
                held = [(at, hi - lo) for lo, hi, at in self._layout.held_by(name, rank)] if (
                    name in self._layout.places and self._layout.group_of(name) == group) else []  # fmt: skip
                if held != [(address.get("start"), address.get("numel"))]:
                    raise CheckpointError(
                        f"{path}: param_slice_mappings puts {name!r} at {address} of group {group}, the layout "
                        f"of the recorded parameter shapes at {held or 'no place'} (rank {rank} of {self.world_size})"
                    )

    # -- what the checkpoint holds (CheckpointReader's interface) ------------------------------------------

    def frozen_param_names(self) -> list[str]:
        return list(self._frozen_shapes)

    def shared_params(self) -> dict[str, str]:
        return dict(self._shared)

    def buffer_names(self) -> list[str]:
        return list(self._buffer_names)

    def buffer(self, name: str) -> torch.Tensor:
        return self._module[name]

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: self._module[n].clone() for n in self._buffer_names}

    def state_dict_keys(self) -> list[str]:
        keys = [k for k in self._module if k in self._shapes or k in self._shared or k in self._buffer_names]
        keys += [k for k in self._shapes if k not in keys]
        return [k for k in keys if self.has_value(self._shared.get(k, k))]

    def has_value(self, name: str) -> bool:
        if name in self._buffer_names:
            return True
        if self._layout is not None and name in self._layout.places:
            return True
        value = self._module.get(name)
        if value is not None and value.numel() == numel(self._shapes.get(name, ())):
            return True
        return name in self._frozen_shapes and self._has_frozen_fragments()

    @property
    def has_optimizer_state(self) -> bool:
        return bool(self._groups)

    def param_group_of(self, name: str) -> int | None:
        return self._group_of.get(name)

    def param_groups(self) -> list[dict]:
        return copy.deepcopy(self._groups)

    def loss_scaler(self) -> dict | None:
        """The fp16 loss scaler's state in shardspeed's keys (core/precision.py, which DeepSpeed's
        `DynamicLossScaler` attributes share; a static scaler has only its scale), or None without fp16."""
        fp16 = (self._raw.get("ds_config") or {}).get("fp16") or {}
        if not self._scaler or fp16.get("enabled") is not True:
            return None
        saved = self._scaler
        return {
            "cur_scale": saved["cur_scale"],
            "cur_iter": saved.get("cur_iter", 0),
            "last_overflow_iter": saved.get("last_overflow_iter", -1),
            "cur_hysteresis": saved.get("cur_hysteresis", saved.get("delayed_shift", 1)),
            "dynamic": saved.get("dynamic", saved.get("dynamic_loss_scale", False)),
        }

    # -- values ---------------------------------------------------------------------------------------------

    def _slice(self, name: str, lo: int, hi: int) -> torch.Tensor:
        self._check_name(name)
        if self._layout is not None and name in self._layout.places:
            return self._gather(name, lo, hi, lambda entry, buffer: entry["fp32"][buffer])
        source = self._stage0_values.get(name)
        if source is None:
            source = self._module.get(name)
        if source is None or source.numel() != numel(self._shapes[name]):
            source = self._frozen_fragments(name)
        return source.reshape(-1)[lo:hi].clone()

    def _gather(self, name: str, lo: int, hi: int, buffer_of) -> torch.Tensor:
        pieces = [
            buffer_of(self._rank_file(p.rank), p.buffer).reshape(-1)[p.start : p.start + p.length]
            for p in self._layout.pieces(name, lo, hi)
        ]
        if not pieces:
            return torch.empty(0)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()

    def _has_frozen_fragments(self) -> bool:
        return bool(self._raw.get("frozen_param_fragments"))

    def _frozen_fragments(self, name: str) -> torch.Tensor:
        """A frozen parameter outside the flat buffers: whole at stage 2, one fragment per rank's
        model-states file at stage 3 (each rank's `ds_tensor`, ceil(numel / world) elements)."""
        if name not in self._frozen_shapes:
            raise CheckpointError(f"checkpoint {self.path} holds no value for parameter {name!r}")
        total = numel(self._frozen_shapes[name])
        if self.zero_stage < 3:
            return (self._raw.get("frozen_param_fragments") or {})[name].reshape(-1)[:total]
        parts = []
        for rank in range(self.world_size):
            path = self.path / f"zero_pp_rank_{rank}_mp_rank_{self.mp_rank:02d}_model_states.pt"
            parts.append(read_file(path, mmap=True)["frozen_param_fragments"][name].reshape(-1))
        return torch.cat(parts)[:total]

    # -- optimizer state --------------------------------------------------------------------------------------

    def optimizer_state(self, name: str) -> dict:
        elements, scalars = self.optimizer_state_slice(name, 0, numel(self.shape(name)))
        return {**scalars, **{k: v.view(self._shapes[name]) for k, v in elements.items()}}

    def optimizer_state_slice(self, name: str, lo: int, hi: int) -> tuple[dict, dict]:
        """Elements [lo, hi) of `name`'s per-element optimizer state (1-D), and its scalar state (e.g. step)."""
        self._check_name(name)
        if self._layout is None or name not in self._layout.places:
            return _split_state(self._stage0_states.get(name, {}), self._shapes[name], lo, hi)
        buffer = self._layout.group_of(name)
        first = self._layout.pieces(name, min(lo, max(numel(self._shapes[name]) - 1, 0)), max(hi, 1))
        held = self._rank_file(first[0].rank if first else 0)["state"].get(buffer, {})
        elements, scalars = {}, {}
        for key, value in held.items():
            if torch.is_tensor(value) and value.dim() == 1 and key != "step":
                elements[key] = self._gather(name, lo, hi, lambda entry, b, k=key: entry["state"][b][k])
            else:
                scalars[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
        return elements, scalars


def _split_state(state: dict, shape, lo: int, hi: int) -> tuple[dict, dict]:
    elements, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and key != "step" and tuple(value.shape) == tuple(shape):
            elements[key] = value.reshape(-1)[lo:hi].clone()
        else:
            scalars[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
    return elements, scalars


def _scaler_of(saved: dict) -> dict | None:
    """The loss scaler's attributes: a pickled LossScaler (ZeRO) or the fp16 optimizer's own keys (stage 0)."""
    scaler = saved.get("loss_scaler")
    if isinstance(scaler, dict):
        return scaler
    if "cur_scale" in saved:
        keys = (
            "cur_scale",
            "cur_iter",
            "last_overflow_iter",
            "scale_factor",
            "scale_window",
            "dynamic_loss_scale",
        )
        return {k: saved[k] for k in keys if k in saved}
    return None
