"""Write shardspeed's checkpoint of a model with MoE layers (`deepspeed.moe.layer.MoE`) in DeepSpeed 0.19.8's
MoE layout, so that DeepSpeed's `load_checkpoint` resumes it (write.py calls this for MoE checkpoints).

What DeepSpeed 0.19.8 writes and reads for such a model (learnt from its engine.py `_save_moe_checkpoint`,
`load_moe_state_dict`, `_get_optimizer_ckpt_name`, moe/utils.py's optimizer-group split and a checkpoint it
wrote; see moe.py for the reading side):

- `mp_rank_00_model_states.pt`: `module` without the expert tensors, `num_experts` (each MoE layer's count, in
  module order), `ds_autoep_layers` None, and the usual entries;
- `layer_<L>_expert_<E>_mp_rank_00_model_states.pt`: expert E's tensors under their global index;
- the optimizer has two parameter groups, as DeepSpeed splits the client's one: `dense-params`, then
  `ep_size_<ep>` (`moe: True`) holding an expert-parallel rank's own experts (layer by layer, local expert by
  local expert); rank r is expert-parallel rank `r % ep` and expert-data-parallel rank `r // ep`;
- ZeRO-0: `expp_rank_<p>_mp_rank_00_optim_states.pt` = {"optimizer": expert-parallel rank p's torch state
  dict}, rank 0's also as the model-states file's `optimizer`;
- ZeRO-1/2: `zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, whose group 0 is the dense flat buffer partitioned
  over every rank and group 1 the expert flat buffer partitioned over the expert-data-parallel group
  (layout.py's `Zero12Layout`); `param_shapes` names the expert group by local index (rank 0's).

Every value comes by name from the universal files our MoE checkpoints carry (moe/checkpoint.py:
`moe_dense_universal_states.pt`, `layer_<L>_expert_<E>_universal_states.pt`: each parameter's fp32 value and
optimizer state whole), so the output may have another world size or ep layout than the save. Refused by name:
fp16/bf16 runs (DeepSpeed's MoE files are read in fp32 only here, and not compared in bf16), AutoEP layers,
frozen parameters, expert groups of several ep sizes, several optimizer groups that differ in their
hyper-parameters, ZeRO-3 (DeepSpeed does not run MoE with it) and checkpoints saved without an optimizer.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format import pickled
from shardspeed.checkpoint.deepspeed_format.layout import Zero12Layout
from shardspeed.checkpoint.files import CheckpointError

__all__ = ["MoESource", "moe_files"]

_EXPERT = re.compile(r"^(?P<prefix>.*\.deepspeed_experts)\.(?P<index>\d+)\.(?P<rest>.+)$")
_GROUP = re.compile(r"^ep_size_(\d+)$")


class MoESource:
    """Our MoE checkpoint in tag folder `path` (model-states `entries`), by name: every trainable parameter's
    whole fp32 value and optimizer state, experts under their global index."""

    def __init__(self, path: Path, entries: dict):
        self.path, self.entries = Path(path), entries
        self._refuse(entries)
        layout = entries["moe_layout"]
        self.world, self.zero_stage = int(layout["dp_world_size"]), int(layout["zero_stage"])
        (group,) = layout["expert_groups"]
        self.ep = int(_GROUP.match(group).group(1))
        self.num_experts = [int(n) for n in entries["num_experts"]]
        dense_file = self.path / files.MOE_DENSE_UNIVERSAL
        if not dense_file.is_file():
            raise CheckpointError(f"{self.path} has no {dense_file.name}: saved without an optimizer, there is "
                                  "no optimizer state for DeepSpeed to resume")  # fmt: skip
        self.params: dict[str, dict] = dict(files.load_file(dense_file)["params"])
        self.dense = [n for n in entries["param_shapes"] if n in self.params]  # module order
        missing = [n for n in entries["param_shapes"] if n not in self.params]
        if missing:
            raise CheckpointError(f"{dense_file} lacks {missing[:4]}")
        self.experts: list[
            list[list[str]]
        ] = []  # [layer][global expert] -> its parameter names, module order
        self.expert_files: dict[tuple[int, int], dict] = {}
        for layer, count in enumerate(self.num_experts):
            if count % self.ep:
                raise CheckpointError(f"{self.path}: MoE layer {layer} has {count} experts, not a multiple of "
                                      f"ep size {self.ep}")  # fmt: skip
            self.experts.append([self._read_expert(layer, e) for e in range(count)])
        self.hyper = self._hyper_parameters()

    def _refuse(self, entries: dict) -> None:
        where = self.path / files.model_states_name()
        config = entries.get("ds_config") or {}
        for key in ("fp16", "bf16"):
            if isinstance(config.get(key), dict) and config[key].get("enabled") is True:
                raise CheckpointError(f"{where} was saved with {key}: MoE checkpoints are written in DeepSpeed's "
                                      "layout for fp32 runs only")  # fmt: skip
        reasons = {
            "ds_autoep_layers": "AutoEP layers: DeepSpeed's AutoEP layout is not written",
            "frozen_param_names": "frozen parameters, which the MoE layout is not written with",
            "pipeline": "a pipeline",
            "tp_partitions": "tensor parallelism",
        }
        for key, what in reasons.items():
            if entries.get(key):
                raise CheckpointError(f"{where} holds {what} ({key!r})")
        groups = (entries.get("moe_layout") or {}).get("expert_groups") or []
        if len(groups) != 1 or not _GROUP.match(str(groups[0])):
            raise CheckpointError(
                f"{where}: expert groups {groups}; the MoE layout is written for one ep size"
            )

    def _read_expert(self, layer: int, expert: int) -> list[str]:
        universal = self.path / files.expert_universal_name(layer, expert)
        weights = self.path / files.expert_model_states_name(layer, expert)
        for file in (universal, weights):
            if not file.is_file():
                raise CheckpointError(f"{self.path} lacks {file.name} (expert {expert} of MoE layer {layer})")
        entries = files.load_file(universal)["params"]
        names = list(entries)
        if not names or not all((m := _EXPERT.match(n)) and int(m["index"]) == expert for n in names):
            raise CheckpointError(f"{universal} does not hold expert {expert}'s parameters: {names[:4]}")
        self.params.update(entries)
        self.expert_files[(layer, expert)] = files.load_file(weights)
        return names

    def _hyper_parameters(self) -> dict:
        """The optimizer groups' hyper-parameters: one set (DeepSpeed's two groups both take it)."""
        file = self.path / files.moe_optim_states_name(0)
        if not file.is_file():
            raise CheckpointError(f"{self.path} lacks {file.name} (the optimizer's groups)")
        domain = files.load_file(file)["optimizer_state_dict"]["domains"]["dense"]
        groups = (
            domain["param_groups"]
            if "param_groups" in domain
            else domain["optimizer_state_dict"]["param_groups"]
        )
        distinct = []
        for group in groups:
            hyper = {k: v for k, v in group.items() if k not in ("params", "name")}
            if hyper not in distinct:
                distinct.append(hyper)
        if len(distinct) != 1:
            raise CheckpointError(f"{file}: the optimizer has {len(distinct)} parameter groups with different "
                                  "hyper-parameters; the MoE layout is written for one")  # fmt: skip
        return distinct[0]

    # -- DeepSpeed's view ----------------------------------------------------------------------------------------

    def local_experts(self, ep_rank: int, ep: int) -> list[str]:
        """Expert-parallel rank `ep_rank`'s expert parameters (global names), in DeepSpeed's group order."""
        names = []
        for layer, count in enumerate(self.num_experts):
            n = count // ep
            for expert in range(ep_rank * n, (ep_rank + 1) * n):
                names += self.experts[layer][expert]
        return names

    def local_name(self, name: str, ep: int) -> str:
        """A global expert name under its local index at ep size `ep` (how DeepSpeed's `param_shapes` name it)."""
        m = _EXPERT.match(name)
        layer = next(i for i, experts in enumerate(self.experts) if any(name in e for e in experts))
        return f"{m['prefix']}.{int(m['index']) % (self.num_experts[layer] // ep)}.{m['rest']}"

    def shape(self, name: str) -> torch.Size:
        return self.params[name]["fp32"].shape

    def per_element_keys(self, name: str) -> list[str]:
        state = self.params[name]["state"]
        return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]

    def scalars(self, name: str) -> dict:
        state = self.params[name]["state"]
        return {
            k: v.clone() if torch.is_tensor(v) else v
            for k, v in state.items()
            if k not in self.per_element_keys(name)
        }


def _torch_state(source: MoESource, ep_rank: int, ep: int) -> dict:
    """ZeRO-0: expert-parallel rank `ep_rank`'s torch optimizer state dict (dense group, then its experts')."""
    dense, experts = source.dense, source.local_experts(ep_rank, ep)
    state = {}
    for index, name in enumerate([*dense, *experts]):
        state[index] = {
            k: v.clone() if torch.is_tensor(v) else v for k, v in source.params[name]["state"].items()
        }
    return {"state": state, "param_groups": _groups(source, ep, [list(range(len(dense))),
                                                                list(range(len(dense), len(dense) + len(experts)))])}  # fmt: skip


def _groups(source: MoESource, ep: int, params: list[list[int]]) -> list[dict]:
    return [
        {"name": "dense-params", **source.hyper, "params": params[0]},
        {"name": f"ep_size_{ep}", "moe": True, **source.hyper, "params": params[1]},
    ]


def _flat(
    source: MoESource, layout: Zero12Layout, names: list[str], rank: int, key: str | None
) -> torch.Tensor:
    """One rank's flat partition of a group: fp32 values (`key` None) or optimizer state `key`."""
    out = torch.zeros(layout.partition_numel[0], dtype=torch.float32)
    for name in names:
        entry = source.params[name]
        value = entry["fp32"] if key is None else entry["state"][key]
        flat = value.reshape(-1).float()
        for lo, hi, at in layout.held_by(name, rank):
            out[at : at + hi - lo] = flat[lo:hi]
    return out


def _partition(source: MoESource, world: int, ep: int, stage: int, rank: int, clip: float) -> dict:
    """ZeRO-1/2: rank `rank`'s `optimizer_state_dict` (dense group over every rank, experts over its
    expert-data-parallel group)."""
    ep_rank, edp_rank, edp = rank % ep, rank // ep, world // ep
    experts = source.local_experts(ep_rank, ep)
    parts = [
        (Zero12Layout([[(n, source.shape(n)) for n in source.dense]], [], world), source.dense, rank),
        (Zero12Layout([[(n, source.shape(n)) for n in experts]], [], edp), experts, edp_rank),
    ]
    fp32, state = [], {}
    for g, (layout, names, k) in enumerate(parts):
        fp32.append(_flat(source, layout, names, k, None)[: layout.expected_fp32_numel(k, 0)])
        state[g] = {key: _flat(source, layout, names, k, key) for key in source.per_element_keys(names[0])}
        state[g].update(source.scalars(names[0]))
    return {
        "loss_scaler": pickled.loss_scaler(), "dynamic_loss_scale": False, "overflow": False, "clip_grad": clip,
        "base_optimizer_state": {"state": state, "param_groups": _groups(source, ep, [[0], [1]])},
        "single_partition_of_fp32_groups": fp32, "zero_stage": pickled.zero_stage(stage),
        "group_paddings": [layout.partition_numel[0] - f.numel() for (layout, _, _), f in zip(parts, fp32)],
        "param_alignment_paddings": [[0] * len(names) for _, names, _ in parts],
        "partition_count": [world, edp],
    }  # fmt: skip


def moe_files(source: MoESource, model_states: dict, world: int, stage: int, version: str) -> dict[str, dict]:
    """{file name: content} of the DeepSpeed MoE checkpoint at `world` ranks and ZeRO `stage`, `model_states`
    being the model-states dict write.py made (dense entries, counters, client state), completed here."""
    ep = source.ep
    if stage == 3:
        raise CheckpointError(
            f"{source.path}: DeepSpeed does not run MoE layers with ZeRO stage 3; write stage 0-2"
        )
    if world % ep:
        raise CheckpointError(f"{source.path}: world size {world} is not a multiple of the ep size {ep}")
    experts = {n for layer in source.experts for e in layer for n in e}
    module = {k: v for k, v in model_states["module"].items() if k not in experts}
    for name in source.dense:
        module[name] = source.params[name]["fp32"].clone()
    model_states.update({
        "module": module,
        "optimizer": _torch_state(source, 0, ep) if stage == 0 else None,
        "param_shapes": None if stage == 0 else [
            OrderedDict((n, tuple(source.shape(n))) for n in source.dense),
            OrderedDict((source.local_name(n, ep), tuple(source.shape(n))) for n in source.local_experts(0, ep)),
        ],
        "frozen_param_shapes": OrderedDict() if stage == 2 else None,
        "frozen_param_fragments": OrderedDict() if stage == 2 else None,
        "shared_params": {} if stage > 0 else None,
        "num_experts": list(source.num_experts),
        "ds_autoep_layers": None,
    })  # fmt: skip
    model_states.pop("sparse_tensor_module_names", None)  # DeepSpeed's MoE save leaves it out
    out = {files.model_states_name(): model_states}
    for (layer, expert), values in source.expert_files.items():
        out[files.expert_model_states_name(layer, expert)] = values
    clip = float((model_states.get("ds_config") or {}).get("gradient_clipping", 1.0))
    if stage == 0:
        for ep_rank in range(ep):
            out[files.expert_optim_states_name(ep_rank)] = {"optimizer": _torch_state(source, ep_rank, ep)}
        return out
    for rank in range(world):
        osd = {**_partition(source, world, ep, stage, rank, clip), "ds_version": version}
        out[files.zero_optim_states_name(rank)] = {
            "optimizer_state_dict": osd, "ds_config": model_states.get("ds_config"), "ds_version": version,
        }  # fmt: skip
    return out
