"""`DeepSpeedMoECheckpoint`: a checkpoint DeepSpeed 0.19 wrote for a model with MoE layers
(`deepspeed.moe.layer.MoE`), presented by parameter name with experts under their global index.

What DeepSpeed 0.19 writes for such a model (learnt from its engine.py `_save_moe_checkpoint` /
`load_moe_state_dict`, moe/layer.py and utils/groups.py; written here from that description):

- `mp_rank_00_model_states.pt`: the usual entries (read.py) with the expert tensors left out of `module`, plus
  `num_experts` (a list: each MoE layer's number of experts, in module order);
- `layer_<L>_expert_<E>_mp_rank_00_model_states.pt`: expert E of the L-th MoE layer (L counts MoE layers in
  module order), its tensors under `<layer>.deepspeed_moe.experts.deepspeed_experts.<E>.<name>`, E the global
  index. Expert-parallel rank p of an `ep_size` group holds the experts `p * n + l` (l < n, n = num_experts /
  ep_size local experts); the ranks of an expert-parallel group are consecutive (`r % ep_size` is rank r's
  expert-parallel rank, `r // ep_size` its expert-data-parallel rank);
- ZeRO stage 0: `expp_rank_<p>_mp_rank_00_optim_states.pt`, expert-parallel rank p's torch optimizer state
  (`{"optimizer": state dict}`): the dense group(s) first, then the group named `ep_size_<ep>` (`moe: True`)
  holding its local experts' parameters, layer by layer, local expert by local expert;
- ZeRO stages 1-2: the usual `zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per rank, whose flat groups are the
  dense groups (partitioned over every rank) and the expert groups (partitioned over the rank's
  expert-data-parallel group, holding the rank's own experts). `param_shapes` names the expert group's
  parameters by their local index (rank 0's).

In bf16 the layout is the same, with 16-bit weights in `module` and the expert files and the fp32 masters in
the optimizer files: at ZeRO stage 0 each expp file's `optimizer` is DeepSpeed's bf16 optimizer state (the
torch state dict under `optimizer_state_dict`, the masters under `fp32_groups`, one per parameter of each
group, in the group's order); at stages 1-2 the partition files are named `bf16_zero_pp_rank_<r>_...` and
hold the masters in their flat groups, as in fp32.

Read here: fp32 and bf16 training, ZeRO stages 0-2, any number of MoE layers sharing one ep size. Refused,
naming the file: fp16 (DeepSpeed 0.19.8 runs no fp16 on a CPU, so no such checkpoint could be checked), layers
of different ep sizes at stage 0, AutoEP layers, the old layout without layer ids (`num_experts` not a list),
and the expert-data-before-expert-parallel topology.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from shardspeed.checkpoint.deepspeed_format import layout as layouts
from shardspeed.checkpoint.deepspeed_format.read import (
    _check_version,
    _zero_stage,
    model_states_path,
    read_file,
)
from shardspeed.checkpoint.files import CheckpointError, expert_optim_states_name

__all__ = ["DeepSpeedMoECheckpoint", "expert_file", "is_deepspeed_moe_state"]

_EXPERT_KEY = re.compile(r"^(?P<prefix>.*)\.deepspeed_experts\.(?P<index>\d+)\.(?P<rest>.+)$")
_GROUP = re.compile(r"^ep_size_(\d+)$")


def is_deepspeed_moe_state(raw: dict) -> bool:
    return bool(raw.get("num_experts"))


def expert_file(tag_dir: Path, layer: int, expert: int, mp_rank: int = 0) -> Path:
    return tag_dir / f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def _expert_name(prefix: str, index: int, rest: str) -> str:
    return f"{prefix}.deepspeed_experts.{index}.{rest}"


class DeepSpeedMoECheckpoint:
    """Every parameter of a DeepSpeed MoE checkpoint by name (experts by global index): `fp32(name)`,
    `optimizer_state(name)` (per-element state in the parameter's shape, scalars as saved), `buffers()`.
    Every file is opened and checked when the object is made, so a bad checkpoint is refused before a load."""

    def __init__(self, tag_dir, raw: dict, mp_rank: int = 0):
        self.path = Path(tag_dir)
        self.mp_rank = mp_rank
        self._model_file = model_states_path(self.path, mp_rank)
        _check_version(self._model_file, raw)
        self.zero_stage = _zero_stage(self._model_file, raw)
        self.world_size = int(raw.get("dp_world_size") or 1)
        self._raw = raw
        self._refuse_unread(raw)
        self._module = raw.get("module") or {}
        buffers = set(raw.get("buffer_names") or [])
        self._buffer_names = [n for n in self._module if n in buffers]
        self.dense_names = [n for n in self._module if n not in buffers]
        self.num_experts = [int(n) for n in raw["num_experts"]]
        self._read_expert_files()
        self._values: dict[str, torch.Tensor] = {}  # name -> fp32 value (flat layouts resolved on demand)
        self._states: dict[str, dict] = {}
        # ZeRO-1/2: name -> (group, its layout, the file rank of each of the layout's ranks, the name it has there)
        self._flat: dict[str, tuple] = {}
        self._groups: list[dict] = []
        if self.zero_stage == 0:
            self._index_stage0()
        else:
            self._index_partitions()

    # -- what is read ----------------------------------------------------------------------------------------

    def _refuse_unread(self, raw: dict) -> None:
        where = self._model_file
        if not isinstance(raw.get("num_experts"), (list, tuple)):
            raise CheckpointError(f"{where} records num_experts {raw.get('num_experts')!r}, not a list per MoE "
                                  "layer: DeepSpeed's old MoE layout without layer ids is not read")  # fmt: skip
        if raw.get("ds_autoep_layers"):
            raise CheckpointError(f"{where} holds AutoEP layers (ds_autoep_layers), which are not read")
        config = raw.get("ds_config") or {}
        if isinstance(config.get("fp16"), dict) and config["fp16"].get("enabled") is True:
            raise CheckpointError(f"{where} was saved with fp16 enabled: DeepSpeed MoE checkpoints are read in "
                                  "fp32 and bf16 only by this version")  # fmt: skip
        self._bf16 = isinstance(config.get("bf16"), dict) and config["bf16"].get("enabled") is True
        if config.get("use_data_before_expert_parallelism"):
            raise CheckpointError(f"{where} was saved with use_data_before_expert_parallelism, whose expert "
                                  "group topology is not read")  # fmt: skip
        if self.zero_stage == 3:
            raise CheckpointError(
                f"{where} records ZeRO stage 3 with MoE layers, which DeepSpeed does not run"
            )

    def _read_expert_files(self) -> None:
        """Every expert file: its layer prefix (all files of a layer agree) and its tensors."""
        self.layer_prefixes: list[str] = []
        self.expert_params: list[str] = []  # an expert's own names ("0.weight"), the order DeepSpeed saves
        self._expert_values: dict[str, torch.Tensor] = {}
        for layer, count in enumerate(self.num_experts):
            prefix = None
            for expert in range(count):
                path = expert_file(self.path, layer, expert, self.mp_rank)
                if not path.is_file():
                    raise CheckpointError(f"DeepSpeed MoE checkpoint {self.path} lacks {path.name} (expert {expert} "
                                          f"of MoE layer {layer}, which has {count} experts)")  # fmt: skip
                content = read_file(path, mmap=True)
                parsed = [_EXPERT_KEY.match(k) for k in content]
                if not parsed or not all(m and int(m["index"]) == expert for m in parsed):
                    raise CheckpointError(f"{path} does not hold expert {expert}'s tensors under "
                                          f"'<layer>.deepspeed_experts.{expert}.<name>': {list(content)[:4]}")  # fmt: skip
                prefixes, rests = {m["prefix"] for m in parsed}, [m["rest"] for m in parsed]
                if len(prefixes) != 1 or (prefix is not None and prefixes != {prefix}):
                    raise CheckpointError(
                        f"{path} names layer {sorted(prefixes)}, expert 0 of its layer {prefix!r}"
                    )
                if self.expert_params and rests != self.expert_params:
                    raise CheckpointError(f"{path} holds {rests}, other experts {self.expert_params}")
                prefix, self.expert_params = prefixes.pop(), rests
                self._expert_values.update(content)
            self.layer_prefixes.append(prefix)

    def expert_names(self) -> list[str]:
        """Every expert parameter under its global index, layer by layer."""
        return [_expert_name(p, e, r) for layer, p in enumerate(self.layer_prefixes)
                for e in range(self.num_experts[layer]) for r in self.expert_params]  # fmt: skip

    def param_shapes(self) -> dict[str, torch.Size]:
        """Dense parameters (module order), then experts by global index."""
        shapes = {n: self._module[n].shape for n in self.dense_names}
        shapes.update({n: self._expert_values[n].shape for n in self.expert_names()})
        return shapes

    def _local_names(self, ep_size: int, layers: list[int]) -> list[str]:
        """An expert-parallel rank's expert parameters under local indices, in the order DeepSpeed's optimizer
        groups hold them: layer by layer, local expert by local expert."""
        names = []
        for layer in layers:
            if self.num_experts[layer] % ep_size:
                raise CheckpointError(f"{self._model_file}: MoE layer {layer} has {self.num_experts[layer]} "
                                      f"experts, not a multiple of ep size {ep_size}")  # fmt: skip
            local = self.num_experts[layer] // ep_size
            names += [
                _expert_name(self.layer_prefixes[layer], i, r)
                for i in range(local)
                for r in self.expert_params
            ]
        return names

    def _global(self, local_name: str, ep_size: int, ep_rank: int) -> str:
        m = _EXPERT_KEY.match(local_name)
        layer = self.layer_prefixes.index(m["prefix"])
        local = self.num_experts[layer] // ep_size
        return _expert_name(m["prefix"], ep_rank * local + int(m["index"]), m["rest"])

    # -- stage 0 ---------------------------------------------------------------------------------------------

    def _index_stage0(self) -> None:
        """Values: dense ones from `module`, experts from their files; optimizer state from the expp files, one
        per expert-parallel rank p (its torch optimizer: the dense groups, then its local experts' group)."""
        self._values.update({n: self._module[n] for n in self.dense_names})
        self._values.update(self._expert_values)
        first = self._expp_file(0)
        if not first.is_file() and self._raw.get("optimizer") is None:
            return  # saved without an optimizer: weights only
        ep = self._expp_ep_size(self._expp_optimizer(0), first)
        for ep_rank in range(ep):
            path = self._expp_file(ep_rank)
            if not path.is_file():
                raise CheckpointError(f"DeepSpeed MoE checkpoint {self.path} lacks {path.name} (the optimizer state "
                                      f"of expert-parallel rank {ep_rank} of {ep})")  # fmt: skip
            inner = self._expp_optimizer(ep_rank)
            if self._expp_ep_size(inner, path) != ep:
                raise CheckpointError(
                    f"{path}: its expert group's ep size differs from {first.name}'s ({ep})"
                )
            dense = [g for g in inner["param_groups"] if not g.get("moe")]
            experts = [g for g in inner["param_groups"] if g.get("moe")]
            global_names = [
                self._global(n, ep, ep_rank) for n in self._local_names(ep, range(len(self.num_experts)))
            ]
            masters = self._expp_masters(ep_rank, inner, path)
            self._take_stage0(
                path, dense, self.dense_names, inner["state"], take=ep_rank == 0, masters=masters
            )
            self._take_stage0(path, experts, global_names, inner["state"], take=True, masters=masters)
            if ep_rank == 0:
                self._groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]

    def _expp_optimizer(self, ep_rank: int) -> dict:
        path = self._expp_file(ep_rank)
        if not path.is_file():
            raise CheckpointError(f"DeepSpeed MoE checkpoint {self.path} lacks {path.name} (the optimizer state of "
                                  "expert-parallel rank 0)")  # fmt: skip
        inner = read_file(path, mmap=True).get("optimizer")
        if self._bf16 and isinstance(inner, dict):  # the bf16 optimizer's state: torch's dict inside
            inner = inner.get("optimizer_state_dict")
        if not isinstance(inner, dict) or "param_groups" not in inner or "state" not in inner:
            raise CheckpointError(f"{path} has no torch optimizer state dict under 'optimizer'")
        return inner

    @staticmethod
    def _expp_ep_size(inner: dict, path: Path) -> int:
        sizes = {_ep_size(path, g) for g in inner["param_groups"] if g.get("moe")}
        if len(sizes) != 1:
            raise CheckpointError(f"{path}: expert groups of ep sizes {sorted(sizes)}; one ep size is read at ZeRO "
                                  "stage 0 (its expp_rank files are per expert-parallel rank of one group)")  # fmt: skip
        return sizes.pop()

    def _expp_masters(self, ep_rank: int, inner: dict, path: Path) -> dict | None:
        """bf16: optimizer index -> its fp32 master (`fp32_groups`, group by group in the groups' order)."""
        if not self._bf16:
            return None
        groups = read_file(path, mmap=True)["optimizer"].get("fp32_groups")
        sizes = [len(g["params"]) for g in inner["param_groups"]]
        if not isinstance(groups, list) or [len(g) for g in groups] != sizes:
            raise CheckpointError(f"{path}: bf16 run without fp32 masters for every parameter of each group "
                                  f"('fp32_groups' sizes {[len(g) for g in groups or []]}, groups {sizes})")  # fmt: skip
        return {i: m for g, ms in zip(inner["param_groups"], groups) for i, m in zip(g["params"], ms)}

    def _expp_file(self, ep_rank: int) -> Path:
        return self.path / expert_optim_states_name(ep_rank, self.mp_rank)

    def _take_stage0(
        self, path: Path, groups: list, names: list, state: dict, take: bool, masters=None
    ) -> None:
        indices = [i for g in groups for i in g["params"]]
        if len(indices) != len(names):
            raise CheckpointError(f"{path}: its groups hold {len(indices)} parameters where the model-states and "
                                  f"expert files give {len(names)} ({names[:3]}...)")  # fmt: skip
        if not take:  # every rank holds the dense state: the first file's is taken
            return
        for index, name in zip(indices, names):
            held = state.get(index, {})
            if masters is not None:
                held = {**held, "fp32 master": masters[index]}  # checked with the state, then taken out
            for key, value in held.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != self._values[name].shape:
                    raise CheckpointError(f"{path}: state {key!r} of index {index} has shape {tuple(value.shape)}, "
                                          f"parameter {name!r} {tuple(self._values[name].shape)}")  # fmt: skip
            if masters is not None:
                self._values[name] = held.pop("fp32 master")
            self._states[name] = held

    # -- stages 1-2 ------------------------------------------------------------------------------------------

    def _partition(self, rank: int) -> tuple[Path, dict]:
        prefix = "bf16_" if self._bf16 else ""
        path = self.path / f"{prefix}zero_pp_rank_{rank}_mp_rank_{self.mp_rank:02d}_optim_states.pt"
        if not path.is_file():
            raise CheckpointError(f"DeepSpeed MoE checkpoint {self.path} is incomplete: saved by {self.world_size} "
                                  f"ranks at ZeRO stage {self.zero_stage}, but {path.name} is missing")  # fmt: skip
        outer = read_file(path, mmap=True)
        _check_version(path, outer)
        osd = outer.get("optimizer_state_dict")
        if not isinstance(osd, dict) or osd.get("zero_stage") != self.zero_stage:
            raise CheckpointError(f"{path} is not a DeepSpeed ZeRO stage {self.zero_stage} partition file")
        if not isinstance(osd.get("base_optimizer_state"), dict):
            raise CheckpointError(
                f"{path} is an elastic ZeRO checkpoint, a layout this version does not read"
            )
        return path, osd

    def _index_partitions(self) -> None:
        shapes = self._raw.get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointError(f"{self._model_file} has no 'param_shapes' list")
        partitions = [self._partition(r) for r in range(self.world_size)]
        first_path, first = partitions[0]
        groups = first["base_optimizer_state"]["param_groups"]
        if len(groups) != len(shapes):
            raise CheckpointError(f"{first_path} holds {len(groups)} groups, param_shapes {len(shapes)}")
        paddings = first.get("param_alignment_paddings") or [None] * len(shapes)
        for g, (group, members) in enumerate(zip(groups, shapes)):
            params = [(n, tuple(s)) for n, s in members.items()]
            if not group.get("moe"):
                ranks = list(range(self.world_size))
                lay = layouts.Zero12Layout([params], [paddings[g]] if paddings[g] else [], self.world_size)
                self._place(g, lay, ranks, {n: n for n, _ in params})
                continue
            ep = _ep_size(first_path, group)
            if self.world_size % ep:
                raise CheckpointError(f"{first_path}: group {group.get('name')} over {self.world_size} ranks")
            edp = self.world_size // ep
            lay = layouts.Zero12Layout([params], [paddings[g]] if paddings[g] else [], edp)
            for ep_rank in range(ep):  # expert-data-parallel rank k of this ep rank is rank ep_rank + k * ep
                ranks = [ep_rank + k * ep for k in range(edp)]
                self._place(g, lay, ranks, {n: self._global(n, ep, ep_rank) for n, _ in params})
        for name, (_, lay, _, local) in self._flat.items():
            if lay.places[local].numel != self._shape_of(name).numel():
                raise CheckpointError(f"{self._model_file}: param_shapes gives {local!r} "
                                      f"{lay.places[local].numel} elements, its saved tensor {self._shape_of(name)}")  # fmt: skip
        for rank, (path, osd) in enumerate(partitions):
            self._check_partition(path, rank, osd)
        self._partitions = [osd for _, osd in partitions]
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        known = set(self._flat)
        missing = [n for n in [*self.dense_names, *self.expert_names()] if n not in known]
        self._values.update({n: self._module[n] for n in missing if n in self._module})  # frozen (fp32)
        self._values.update({n: self._expert_values[n] for n in missing if n in self._expert_values})

    def _place(self, group: int, lay, ranks: list[int], global_of: dict[str, str]) -> None:
        for local, name in global_of.items():
            self._flat[name] = (group, lay, ranks, local)

    def _check_partition(self, path: Path, rank: int, osd: dict) -> None:
        """Every group's fp32 slice and per-element state have the sizes the layout gives this rank, so that no
        parameter can fail half way through a load."""
        layouts_ = self._layouts_by_group()
        counts = list(osd.get("partition_count") or [])
        fp32 = list(osd.get("single_partition_of_fp32_groups") or [])
        if len(counts) != len(layouts_) or len(fp32) != len(layouts_):
            raise CheckpointError(f"{path} holds {len(fp32)} fp32 groups and {len(counts)} partition counts; "
                                  f"param_shapes gives {len(layouts_)} groups")  # fmt: skip
        states = osd["base_optimizer_state"].get("state", {})
        for g, lay in enumerate(layouts_):
            k = rank // (self.world_size // lay.world)  # the rank's place in the group's partitioning
            if counts[g] != lay.world or fp32[g].numel() != lay.expected_fp32_numel(k, 0):
                raise CheckpointError(f"{path}: group {g} partitioned over {counts[g]} ranks with "
                                      f"{fp32[g].numel()} fp32 elements; its layout gives {lay.world} ranks and "
                                      f"{lay.expected_fp32_numel(k, 0)}")  # fmt: skip
            for key, value in states.get(g, {}).items():
                per_element = torch.is_tensor(value) and value.dim() == 1 and key != "step"
                if per_element and value.numel() != lay.partition_numel[0]:
                    raise CheckpointError(f"{path}: optimizer state {key!r} of group {g} has {value.numel()} "
                                          f"elements, expected {lay.partition_numel[0]}")  # fmt: skip

    def _layouts_by_group(self) -> list:
        by_group = {}
        for group, lay, _, _ in self._flat.values():
            by_group.setdefault(group, lay)
        return [by_group[g] for g in sorted(by_group)]

    def _gather(self, name: str, buffer_of) -> torch.Tensor:
        group, lay, ranks, local = self._flat[name]
        pieces = [buffer_of(self._partitions[ranks[p.rank]], group).reshape(-1)[p.start : p.start + p.length]
                  for p in lay.pieces(local, 0, lay.places[local].numel)]  # fmt: skip
        return torch.cat(pieces) if pieces else torch.empty(0)

    # -- values ----------------------------------------------------------------------------------------------

    def has_optimizer_state(self) -> bool:
        return bool(self._groups)

    def param_groups(self) -> list[dict]:
        return copy.deepcopy(self._groups)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: self._module[n].clone() for n in self._buffer_names}

    def fp32(self, name: str) -> torch.Tensor:
        if name in self._flat:
            flat = self._gather(name, lambda osd, g: osd["single_partition_of_fp32_groups"][g])
            return flat.view(self._shape_of(name)).clone()
        if name not in self._values:
            raise CheckpointError(f"DeepSpeed MoE checkpoint {self.path} holds no value for {name!r}")
        return self._values[name].float().clone()

    def optimizer_state(self, name: str) -> dict:
        """Per-element state (in the parameter's shape) and scalar state (`step`) of `name`; {} without one."""
        if name in self._flat:
            group, _, ranks, _ = self._flat[name]
            held = self._partitions[ranks[0]]["base_optimizer_state"]["state"].get(group, {})
            out = {}
            for key, value in held.items():
                if torch.is_tensor(value) and value.dim() == 1 and key != "step":
                    flat = self._gather(
                        name, lambda osd, g, k=key: osd["base_optimizer_state"]["state"][g][k]
                    )
                    out[key] = flat.view(self._shape_of(name)).clone()
                else:
                    out[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
            return out
        held = self._states.get(name, {})
        return {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in held.items()}

    def _shape_of(self, name: str) -> torch.Size:
        value = self._module.get(name, self._expert_values.get(name))
        if value is None:
            raise CheckpointError(f"{self._model_file}: parameter {name!r} is in param_shapes but neither in "
                                  "'module' nor in an expert file")  # fmt: skip
        return value.shape


def _ep_size(path: Path, group: dict) -> int:
    m = _GROUP.match(str(group.get("name")))
    if not m:
        raise CheckpointError(
            f"{path}: expert parameter group named {group.get('name')!r}, not 'ep_size_<n>'"
        )
    return int(m.group(1))
