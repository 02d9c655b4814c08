"""Checkpoints of models with MoE layers: DeepSpeed's expert files, and loading at another ep size.

`MoEModelStates` is the checkpoint part (checkpoint/parts.py) of a model with MoE layers: `ModelStates`
(checkpoint/model_states.py) with the experts in their own files. The functions here take that part (its
module, optimizer wrapper, `moe` — the engine's `ExpertParallelism` — and placement).

Files in a tag folder, besides the usual model-states and RNG files (checkpoint/engine_io.py):

    layer_<L>_expert_<E>_mp_rank_00_model_states.pt   DeepSpeed's expert file: expert E (global index) of the
                                                      L-th MoE layer, its state-dict entries under the global
                                                      index; written by the expert-data-parallel rank 0
    moe_rank_<D>_mp_rank_00_optim_states.pt           data-parallel rank D's optimizer state (every domain)
    moe_dense_universal_states.pt                     every dense parameter's fp32 value and optimizer state,
    layer_<L>_expert_<E>_universal_states.pt          and every expert's, by name with global expert indices

`mp_rank_00_model_states.pt` holds the dense weights only (`module` without expert tensors, as DeepSpeed),
plus `num_experts` and `moe_layout` (and DeepSpeed's `ds_autoep_layers` with AutoEP layers, whose stacked experts
are split into the same per-expert files: autoep_checkpoint.py). A load with the same layout (world size, ZeRO stage, ep sizes, buckets)
takes the weights and the per-rank optimizer state and resumes bit for bit. Any other layout — another ep
size, world size or stage — rebuilds every parameter, fp32 master and optimizer state from the universal
files by name (each rank reads only its own experts), then keeps training. Writing the universal files
gathers each parameter's state once per save (collective over the parameter's group): the price of loading
at any layout. Not supported here: NVMe optimizer offload and frozen expert parameters at a changed layout.
"""

from __future__ import annotations

import re

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format import deepspeed_raw
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.model_states import ModelStates
from shardspeed.checkpoint.parts import LoadContext, SaveOptions
from shardspeed.moe import autoep_checkpoint as autoep
from shardspeed.moe.deepspeed_checkpoint import check_deepspeed_moe, load_deepspeed_moe
from shardspeed.moe.named_state import expert_entries, is_managed, set_full_state
from shardspeed.moe.utils import is_moe_param
from shardspeed.zero.api import (
    GatheredParameters,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
)

__all__ = [
    "MoEModelStates",
    "expert_file_name",
    "load_moe",
    "moe_model_states",
    "save_moe",
]

_LOCAL = re.compile(r"^(?P<prefix>.*\.deepspeed_experts\.)(?P<index>\d+)(?P<rest>\..*)$")
DENSE_UNIVERSAL = files.MOE_DENSE_UNIVERSAL


expert_file_name = files.expert_model_states_name  # the file names live with the others (checkpoint/files.py)
expert_universal_name = files.expert_universal_name
optimizer_file_name = files.moe_optim_states_name


class MoEModelStates(ModelStates):
    """The module and optimizer wrapper of a model with MoE layers; `moe` is the engine's MoE part."""

    keys = (*ModelStates.keys, "num_experts", "moe_layout", autoep.LAYERS_KEY)
    reads_universal = False  # experts have no place in the universal layout's per-parameter folders yet

    def __init__(self, *args, moe, **kwargs):
        super().__init__(*args, **kwargs)
        self.moe = moe

    def _stage_wrappers(self) -> list:
        return [d.wrapper for d in self.optimizer.domains]  # one per reduction domain (moe/optimizer.py)

    def param_shapes(self) -> dict[str, tuple]:
        stacked = autoep.expert_param_names(self.module)  # AutoEP's: [local experts, ...], per ep size
        shapes = without_experts(super().param_shapes())  # experts are in their own files, by global index
        return {k: v for k, v in shapes.items() if k not in stacked}

    def state_dict(self, options: SaveOptions) -> dict:
        return moe_model_states(self, super().state_dict(options))

    def write_files(self, staging, options: SaveOptions) -> None:
        save_moe(self, staging)  # expert files, per-rank optimizer state (collective)

    def check(self, path, state: dict, options) -> None:
        if deepspeed_raw(state) is not None and not options.universal:  # DeepSpeed's expert files
            check_deepspeed_moe(self, path, state, options.strict)
            return
        super().check(path, state, options)
        autoep.check_layers_metadata(self.module, path, state.get(autoep.LAYERS_KEY))
        _check_expert_files(self, path, state)

    def needs_reshard(self, state: dict, path) -> bool:
        return state.get("moe_layout") != moe_layout(self)  # DeepSpeed's: no moe_layout, always by name

    def load_state_dict(self, entries: dict, ctx: LoadContext) -> None:
        ctx.resharded = load_moe(self, ctx.path, ctx.state, ctx.options.strict, ctx.options.optimizer)


def _check_expert_files(part, path, state: dict) -> None:
    """Every file this rank's experts will be read from exists (a rank missing one would otherwise fail alone,
    half-way through the load)."""
    if "moe_layout" not in state:
        return  # not an MoE checkpoint: load_moe names that
    reshard = part.optimizer is not None and part.needs_reshard(state, path)
    name = expert_universal_name if reshard else expert_file_name
    wanted = [(layer_id, global_id) for layer_id, global_id, *_ in expert_entries(part)]
    wanted += autoep.local_expert_ids(part.module, part.moe.expert_rank)
    for layer_id, global_id in wanted:
        if not (path / name(layer_id, global_id)).is_file():
            raise CheckpointError(
                f"checkpoint {path} has no {name(layer_id, global_id)} (expert {global_id} of MoE layer {layer_id})"
            )


def _is_expert_key(name: str) -> bool:
    return _LOCAL.match(name) is not None


def moe_layout(part) -> dict:
    wrapper = part.optimizer
    buckets = {}
    if wrapper is not None and wrapper.zero_stage > 0:
        buckets = {d.name: [b.layout() for b in d.wrapper.buckets] for d in wrapper.domains}
    return {
        "dp_world_size": part.placement.dp_world_size,
        "zero_stage": part.zero_stage,
        "expert_groups": part.moe.group_names(),
        "buckets": buckets,
    }


def moe_model_states(part, state: dict) -> dict:
    """The model-states dict of an MoE part: expert tensors out (they are in the expert files)."""
    stacked = autoep.expert_param_names(part.module)
    state["module"] = {k: v for k, v in state["module"].items() if not (_is_expert_key(k) or k in stacked)}
    state["optimizer"] = None  # in moe_rank_<D> files
    state["zero_partitions"] = 0
    state["num_experts"] = [layer.num_experts for layer in part.moe.layers]
    state["moe_layout"] = moe_layout(part)
    if stacked:
        state[autoep.LAYERS_KEY] = autoep.layers_metadata(part.module, part.moe.groups)
    return state


def without_experts(shapes: dict) -> dict:
    return {k: v for k, v in shapes.items() if not _is_expert_key(k)}


# -- save ----------------------------------------------------------------------------------------------------


def _full_state(param) -> dict:
    """{"fp32": full value, "state": {key: full optimizer state}} (collective over the param's group)."""
    owner = getattr(param, "_shardspeed_zero", None)
    entry = {"fp32": safe_get_full_fp32_param(param).cpu(), "state": {}}
    wrapper, index = owner
    if index is None:
        raw = wrapper.optimizer.state.get(wrapper.masters.get(param, param), {})
    else:
        raw = wrapper.shard_state(index)
    for key in sorted(raw):
        value = raw[key]
        if torch.is_tensor(value) and value.dim() > 0:
            value = safe_get_full_optimizer_state(param, key)
        entry["state"][key] = value.cpu().clone() if torch.is_tensor(value) else value
    return entry


def refuse_folded(part) -> None:
    """AutoEP folded onto AutoTP (autoep/folded_layer.py): its expert groups span tensor lanes, which the expert
    files' layout does not describe; refused on every rank alike, before anything is written or read."""
    if any(getattr(layer, "folding", None) is not None for layer in part.moe.layers):
        raise NotImplementedError(
            "checkpoints of a model with AutoEP folded onto AutoTP (expert_parallel with "
            "tensor_parallel.autotp_size > 1) are not built yet"
        )


def save_moe(part, staging) -> None:
    """Expert files, this rank's optimizer state and the universal files (collective)."""
    refuse_folded(part)
    if part.optimizer is not None:
        partition = {"optimizer_state_dict": part.optimizer.state_dict(), "ds_config": part.ds_config}
        files.save_file(partition, staging / optimizer_file_name(part.placement.dp_rank))
    experts = list(expert_entries(part))
    expert_params = [p for _, _, expert, _, _ in experts for p in expert.parameters()]
    with GatheredParameters(expert_params):  # stage 3: within each expert-data-parallel group
        for layer_id, global_id, expert, names, _ in experts:
            if _edp_rank(part, expert) == 0:
                values = dict(zip(names, (t.detach().clone() for t in expert.state_dict().values())))
                files.save_file(values, staging / expert_file_name(layer_id, global_id))
    for layer_id, global_id, group, values in autoep.expert_files(part.module, part.moe.expert_rank):
        if part.moe.groups[group].edp_rank == 0:
            files.save_file(values, staging / expert_file_name(layer_id, global_id))
    if part.optimizer is None:
        return
    dense = {
        n: _full_state(p) for n, p in part.module.named_parameters() if is_managed(p) and not is_moe_param(p)
    }
    if part.placement.dp_rank == 0:
        files.save_file({"params": dense, "loss_scaler": part.optimizer.scaler.state_dict()},
                        staging / DENSE_UNIVERSAL)  # fmt: skip
    for layer_id, global_id, expert, names, local_prefix in experts:
        global_of = {local: g for g, local in names.items()}
        entries = {
            global_of[local_prefix + n]: _full_state(p) for n, p in expert.named_parameters() if is_managed(p)
        }
        if _edp_rank(part, expert) == 0:
            files.save_file({"params": entries}, staging / expert_universal_name(layer_id, global_id))
    for layer_id, global_id, group, entries in autoep.universal_entries(part.module, part.moe.expert_rank,
                                                                        _full_state):  # fmt: skip
        if part.moe.groups[group].edp_rank == 0:
            files.save_file({"params": entries}, staging / expert_universal_name(layer_id, global_id))


def _edp_rank(part, expert) -> int:
    p = next(expert.parameters())
    return part.moe.groups[p.group_name].edp_rank


# -- load ----------------------------------------------------------------------------------------------------


def load_moe(part, path, state: dict, strict: bool, load_optimizer: bool) -> bool:
    """Load an MoE checkpoint; returns True when it was saved at another layout (rebuilt from names)."""
    refuse_folded(part)
    if deepspeed_raw(state) is not None:
        load_deepspeed_moe(part, path, state, strict, load_optimizer)
        return True
    if "moe_layout" not in state:
        raise CheckpointError(f"checkpoint {path} was not saved from a model with MoE layers")
    same = state["moe_layout"] == moe_layout(part)
    if part.optimizer is None:  # weights only: dense ones from the model file, experts by global index
        if state.get("zero_stage") == 3 or part.zero_stage == 3:
            raise CheckpointError(
                f"checkpoint {path}: loading MoE weights without an optimizer needs ZeRO < 3"
            )
        _load_weights(part, path, {**state["module"], **_expert_values(part, path)}, strict)
    elif same:
        _load_same_layout(part, path, state, strict, load_optimizer)
    else:
        _load_any_layout(part, path, state, strict, load_optimizer)
    return not same


def _expert_values(part, path) -> dict:
    """This rank's experts' tensors from their files, under the local names of this model."""
    values = {}
    for layer_id, global_id, _, names, _ in expert_entries(part):
        saved = autoep.load_expert_file(
            path / expert_file_name(layer_id, global_id), layer_id, global_id, names
        )
        values.update({local: saved[g] for g, local in names.items()})
    return {**values, **autoep.stack_expert_values(part.module, path, part.moe.expert_rank, expert_file_name)}


def _load_weights(part, path, module_state: dict, strict: bool, params_elsewhere: bool = False) -> None:
    params = {n for n, _ in part.module.named_parameters()}
    missing, unexpected = part.module.load_state_dict(module_state, strict=False)
    missing = [k for k in missing if not (params_elsewhere and k in params)]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}"
        )


def _load_same_layout(part, path, state, strict, load_optimizer) -> None:
    module_state = dict(state["module"])
    stage3 = part.zero_stage == 3  # parameters come from the optimizer's shards
    if not stage3:
        module_state.update(_expert_values(part, path))
    _load_weights(part, path, module_state, strict, params_elsewhere=stage3)
    if not (load_optimizer or stage3):
        part.optimizer.refresh_masters_from_module()
        return
    saved = files.load_file(path / optimizer_file_name(part.placement.dp_rank))["optimizer_state_dict"]
    part.optimizer.load_state_dict(saved, load_optimizer_states=load_optimizer)


def _load_any_layout(part, path, state, strict, load_optimizer) -> None:
    universal = {}
    dense_file = path / DENSE_UNIVERSAL
    if not dense_file.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {DENSE_UNIVERSAL}: it cannot be loaded at another layout"
        )
    dense = files.load_file(dense_file)
    universal.update(dense["params"])
    for layer_id, global_id, _, _, _ in expert_entries(part):
        file = path / expert_universal_name(layer_id, global_id)
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} has no {file.name}: expert {global_id} of MoE layer {layer_id} "
                                  "is not in it (saved with fewer experts?)")  # fmt: skip
        universal.update(files.load_file(file)["params"])
    # AutoEP's stacked experts: this rank's experts' entries stacked, under the local names
    universal.update(
        autoep.stack_universal_entries(part.module, path, part.moe.expert_rank, expert_universal_name)
    )
    local_to_global = {local: g for _, _, _, names, _ in expert_entries(part) for g, local in names.items()}
    named = [(local_to_global.get(n, n), p) for n, p in part.module.named_parameters()]
    # dense first on every rank, then this rank's experts: each group sees its collectives in one order
    ordered = [x for x in named if not is_moe_param(x[1])] + [x for x in named if is_moe_param(x[1])]
    with torch.no_grad():
        for name, p in ordered:
            if not is_managed(p):
                continue
            if name not in universal:
                raise CheckpointError(f"checkpoint {path} has no value for parameter {name!r}")
            set_full_state(p, universal[name], load_optimizer)
    buffers = {k: v for k, v in state["module"].items() if k not in dict(part.module.named_parameters())}
    part.module.load_state_dict(buffers, strict=False)
    if load_optimizer and dense.get("loss_scaler") is not None:
        part.optimizer.scaler.load_state_dict(dense["loss_scaler"])
