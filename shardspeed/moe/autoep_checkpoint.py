"""AutoEP layers in MoE checkpoints: each rank's stacked experts, written and read one expert per file.

An `AutoEPMoELayer` holds its rank's `n` local experts stacked in three tensors (`experts.w1`, `w2`, `w3`, each
`[n, ...]`). A checkpoint must not depend on how many ranks shared the experts, so each expert is written on its
own under its global index E = ep_rank · n + local index, in DeepSpeed's layout (learnt from its engine's
`_save_moe_checkpoint` and `load_moe_state_dict`):

    layer_<L>_expert_<E>_mp_rank_00_model_states.pt   {"<layer path>.experts.w1.<E>": [..] (one expert), w2, w3}

and, for loading at another ep size, world size or ZeRO stage, the universal file of moe/checkpoint.py:

    layer_<L>_expert_<E>_universal_states.pt          {"params": {"<layer path>.experts.w1.<E>":
                                                                  {"fp32": [..], "state": {exp_avg: [..], step}}}}

L counts MoE layers of both kinds in module order (`moe_layer_ids`), as DeepSpeed numbers them. The
model-states file records DeepSpeed's `ds_autoep_layers` list (one entry per AutoEP layer: path, expert counts,
ep size, rank 0's place), checked against the model before anything is loaded. Loading stacks a rank's experts
back into its `[n, ...]` tensors, whatever ep size saved them.
"""

from __future__ import annotations

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.moe.autoep.layer import AutoEPMoELayer
from shardspeed.moe.layer import MoE

__all__ = [
    "EXPERT_WEIGHTS",
    "LAYERS_KEY",
    "autoep_layers",
    "check_layers_metadata",
    "expert_param_names",
    "layers_metadata",
    "load_expert_file",
    "local_expert_ids",
    "moe_layer_ids",
    "split_full_state",
    "stack_expert_values",
    "stack_universal_entries",
]

EXPERT_WEIGHTS = ("w1", "w2", "w3")
LAYERS_KEY = "ds_autoep_layers"  # DeepSpeed's model-states key (checkpoint.constants.AUTOEP_LAYERS_KEY)
_CHECKED_FIELDS = ("moe_layer_id", "module_path", "num_experts")  # what must match the model to load


def moe_layer_ids(module) -> list[tuple[int, str, object]]:
    """(layer id, module path, layer) of every MoE layer, `MoE` or `AutoEPMoELayer`, in module order."""
    layers = [(path, m) for path, m in module.named_modules() if isinstance(m, (MoE, AutoEPMoELayer))]
    return [(layer_id, path, m) for layer_id, (path, m) in enumerate(layers)]


def autoep_layers(module) -> list[tuple[int, str, AutoEPMoELayer]]:
    return [entry for entry in moe_layer_ids(module) if isinstance(entry[2], AutoEPMoELayer)]


def _prefix(path: str) -> str:
    return f"{path}.experts" if path else "experts"


def expert_param_names(module) -> set[str]:
    """The state-dict names of every AutoEP layer's stacked expert tensors (they live in the expert files)."""
    return {f"{_prefix(path)}.{w}" for _, path, _ in autoep_layers(module) for w in EXPERT_WEIGHTS}


def layers_metadata(module, groups) -> list[dict]:
    """DeepSpeed's `ds_autoep_layers`: one entry per AutoEP layer, this rank's place in it (`groups`: the
    engine's ExpertGroups)."""
    entries = []
    for layer_id, path, layer in autoep_layers(module):
        group = groups[layer.ep_group_name]
        start = group.ep_rank * layer.num_local_experts
        entries.append({
            "moe_layer_id": layer_id, "module_path": path, "num_experts": layer.num_experts,
            "num_local_experts": layer.num_local_experts, "ep_size": layer.ep_size,
            "expert_key_prefix": _prefix(path), "checkpoint_format": "per_expert_files",
            "checkpoint_format_version": None, "ep_group_name": layer.ep_group_name, "ep_rank": group.ep_rank,
            "expert_data_parallel_rank": group.edp_rank, "expert_data_parallel_world_size": group.edp_size,
            "global_expert_start": start, "global_expert_end": start + layer.num_local_experts,
        })  # fmt: skip
    return entries


def layers_metadata_static(module) -> list[dict]:
    """The rank-independent fields of `layers_metadata` (no groups needed)."""
    return [
        {"moe_layer_id": layer_id, "module_path": path, "num_experts": layer.num_experts}
        for layer_id, path, layer in autoep_layers(module)
    ]


def check_layers_metadata(module, path, saved) -> None:
    """The checkpoint's AutoEP layers (its `ds_autoep_layers`) are the model's: same layer ids, paths and expert
    counts (the ep size may differ). Raises CheckpointError naming the difference."""
    ours = [{k: e[k] for k in _CHECKED_FIELDS} for e in layers_metadata_static(module)]
    if saved is None and not ours:
        return
    if saved is None:
        raise CheckpointError(
            f"checkpoint {path} holds no AutoEP layers ({LAYERS_KEY}); the model has {ours}"
        )
    if not isinstance(saved, list) or not all(isinstance(e, dict) for e in saved):
        raise CheckpointError(f"checkpoint {path}: {LAYERS_KEY} is malformed (expected a list of dicts)")
    theirs = []
    for entry in saved:
        missing = [k for k in _CHECKED_FIELDS if k not in entry]
        if missing:
            raise CheckpointError(f"checkpoint {path}: a {LAYERS_KEY} entry lacks {missing}")
        theirs.append({k: entry[k] for k in _CHECKED_FIELDS})
    if theirs != ours:
        raise CheckpointError(
            f"checkpoint {path} holds AutoEP layers {theirs}, the model {ours}: not the same MoE layers"
        )


def _global_ids(layer, ep_rank: int) -> list[int]:
    n = layer.num_local_experts
    return [ep_rank * n + local for local in range(n)]


def local_expert_ids(module, ep_rank_of) -> list[tuple[int, int]]:
    """(layer id, global expert id) of this rank's AutoEP experts."""
    return [
        (layer_id, global_id)
        for layer_id, _, layer in autoep_layers(module)
        for global_id in _global_ids(layer, ep_rank_of(layer.ep_group_name))
    ]


def expert_files(module, ep_rank_of) -> list[tuple[int, int, str, dict]]:
    """(layer id, global expert id, group name, {DeepSpeed key: one expert's tensor}) of this rank's AutoEP
    experts; `ep_rank_of(group name)` is this rank's expert-parallel rank."""
    out = []
    for layer_id, path, layer in autoep_layers(module):
        for local, global_id in enumerate(_global_ids(layer, ep_rank_of(layer.ep_group_name))):
            values = {
                f"{_prefix(path)}.{w}.{global_id}": getattr(layer.experts, w).detach()[local].clone()
                for w in EXPERT_WEIGHTS
            }
            out.append((layer_id, global_id, layer.ep_group_name, values))
    return out


def split_full_state(entry: dict, local: int) -> dict:
    """One expert's slice of a stacked parameter's {"fp32", "state"} entry (scalars such as `step` copied)."""

    def pick(value):
        return value[local].clone() if torch.is_tensor(value) and value.dim() > 0 else value

    return {"fp32": pick(entry["fp32"]), "state": {k: pick(v) for k, v in entry["state"].items()}}


def universal_entries(module, ep_rank_of, full_state) -> list[tuple[int, int, str, dict]]:
    """(layer id, global expert id, group name, {DeepSpeed key: entry}) of this rank's trainable AutoEP expert
    tensors, `full_state(param)` giving a stacked parameter's whole fp32 value and optimizer state (collective
    over its expert-data-parallel group)."""
    out = {}
    for layer_id, path, layer in autoep_layers(module):
        ids = _global_ids(layer, ep_rank_of(layer.ep_group_name))
        for w in EXPERT_WEIGHTS:
            param = getattr(layer.experts, w)
            if not param.requires_grad:
                continue  # frozen: in the expert files only (no optimizer state)
            stacked = full_state(param)
            for local, global_id in enumerate(ids):
                entries = out.setdefault((layer_id, global_id, layer.ep_group_name), {})
                entries[f"{_prefix(path)}.{w}.{global_id}"] = split_full_state(stacked, local)
    return [(*key, entries) for key, entries in out.items()]


def load_expert_file(file, layer_id: int, global_id: int, keys) -> dict:
    """One expert's file (`deepspeed.moe` or AutoEP: the same layout), refused naming it when it is missing or
    lacks any of `keys` (then it was saved from another expert module)."""
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {file.parent} has no {file.name} (expert {global_id} of MoE layer {layer_id})"
        )
    saved = files.load_file(file)
    missing = [k for k in keys if k not in saved]
    if missing:
        raise CheckpointError(
            f"{file} lacks {missing[:4]}: not expert {global_id} of this model's layer (saved from another module)"
        )
    return saved


def stack_expert_values(module, path, ep_rank_of, file_name) -> dict:
    """{local name: stacked [n, ...] tensor} of this rank's AutoEP experts, read from their expert files
    (`file_name(layer id, global id)`)."""
    values = {}
    for layer_id, prefix_path, layer in autoep_layers(module):
        prefix = _prefix(prefix_path)
        rows = {w: [] for w in EXPERT_WEIGHTS}
        for global_id in _global_ids(layer, ep_rank_of(layer.ep_group_name)):
            keys = [f"{prefix}.{w}.{global_id}" for w in EXPERT_WEIGHTS]
            saved = load_expert_file(path / file_name(layer_id, global_id), layer_id, global_id, keys)
            for w, key in zip(EXPERT_WEIGHTS, keys):
                rows[w].append(saved[key])
        values.update({f"{prefix}.{w}": torch.stack(rows[w]) for w in EXPERT_WEIGHTS})
    return values


def stack_universal_entries(module, path, ep_rank_of, file_name) -> dict:
    """{local name: {"fp32": stacked, "state": {...}}} of this rank's trainable AutoEP expert tensors, from the
    universal files (`file_name(layer id, global id)`) of the experts this rank now holds."""
    entries = {}
    for layer_id, prefix_path, layer in autoep_layers(module):
        prefix = _prefix(prefix_path)
        trainable = [w for w in EXPERT_WEIGHTS if getattr(layer.experts, w).requires_grad]
        per_expert = {w: [] for w in trainable}
        for global_id in _global_ids(layer, ep_rank_of(layer.ep_group_name)):
            keys = [f"{prefix}.{w}.{global_id}" for w in trainable]
            file = path / file_name(layer_id, global_id)
            saved = load_expert_file(file, layer_id, global_id, ["params"])["params"]
            missing = [k for k in keys if k not in saved]
            if missing:
                raise CheckpointError(f"{file} lacks {missing}")
            for w, key in zip(trainable, keys):
                per_expert[w].append(saved[key])
        for w, experts in per_expert.items():
            entries[f"{prefix}.{w}"] = _stack_entries(experts)
    return entries


def _stack_entries(experts: list[dict]) -> dict:
    """Experts' {"fp32", "state"} entries as one stacked parameter's (scalars from the first: the same step)."""
    first = experts[0]
    state = {}
    for key, value in first["state"].items():
        if torch.is_tensor(value) and value.dim() > 0:
            state[key] = torch.stack([e["state"][key] for e in experts])
        else:
            state[key] = value
    return {"fp32": torch.stack([e["fp32"] for e in experts]), "state": state}
