"""Resuming a model with MoE layers from a checkpoint DeepSpeed 0.19 wrote (its expert and expp files).

DeepSpeed's files are read by name, experts under their global index
(checkpoint/deepspeed_format/moe.py: `DeepSpeedMoECheckpoint`); this rank's experts are mapped to global
indices the way DeepSpeed numbers them (`moe/named_state.py`'s `expert_entries`: expert-parallel rank p holds experts
`p * n .. p * n + n - 1` of each layer). Each parameter, its fp32 master and its optimizer state are then set
by name, as a load at another layout of our own checkpoints is (`set_full_state`), so the checkpoint loads at
any ep size, ZeRO stage 0-2 and world size that the model's expert counts allow — DeepSpeed itself loads it
only at the ep size and world size it was saved at.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardspeed.checkpoint.files import CheckpointError
from shardspeed.moe.named_state import expert_entries, is_managed, set_full_state
from shardspeed.moe.utils import is_moe_param

__all__ = ["check_deepspeed_moe", "load_deepspeed_moe"]


def _global_names(part) -> dict[str, str]:
    """This rank's parameter names -> the checkpoint's (experts under their global index)."""
    local_to_global = {local: g for _, _, _, names, _ in expert_entries(part) for g, local in names.items()}
    return {n: local_to_global.get(n, n) for n, _ in part.module.named_parameters()}


def check_deepspeed_moe(part, path: Path, state, strict: bool) -> None:
    """Match the checkpoint's MoE layers and parameters to the model before anything is loaded."""
    reader = state.moe
    ours = [layer.num_experts for layer in part.moe.layers]
    if ours != reader.num_experts:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} has MoE layers of {reader.num_experts} experts, the model "
            f"{ours}: experts are matched by layer and global index"
        )
    saved = reader.param_shapes()
    params = dict(part.module.named_parameters())
    names = _global_names(part)
    mismatched = [
        f"{g!r}: checkpoint {tuple(saved[g])}, model {tuple(params[n].shape)}"
        for n, g in names.items()
        if g in saved and tuple(saved[g]) != tuple(params[n].shape)
    ]
    if mismatched:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} was saved from a different model: {'; '.join(mismatched[:6])}"
        )
    missing = [g for g in names.values() if g not in saved]
    dense_saved = set(reader.dense_names)
    unexpected = sorted(dense_saved - set(names.values()))
    if missing or (strict and unexpected):
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} does not match the model: missing {missing[:6]}, unexpected "
            f"{unexpected[:6]}" + ("" if missing else " (load_module_strict=False loads the rest)")
        )


def load_deepspeed_moe(part, path: Path, state, strict: bool, load_optimizer: bool) -> None:
    """Set every parameter (dense first on every rank, then this rank's experts, so that each group sees
    its collectives in one order), its fp32 master and its optimizer state by name; then the buffers and the
    optimizer groups' hyper-parameters."""
    reader = state.moe
    if load_optimizer and part.optimizer is not None and not reader.has_optimizer_state():
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} holds no optimizer state (no expp_rank or zero_pp_rank files); "
            "load it with load_optimizer_states=False"
        )
    names = _global_names(part)
    params = list(part.module.named_parameters())
    ordered = [x for x in params if not is_moe_param(x[1])] + [x for x in params if is_moe_param(x[1])]
    with torch.no_grad():
        for local, p in ordered:
            name = names[local]
            if part.optimizer is None or not is_managed(p):
                p.data.copy_(reader.fp32(name).to(p.dtype))  # no optimizer, or a frozen parameter
                continue
            state_of = reader.optimizer_state(name) if load_optimizer else {}
            set_full_state(p, {"fp32": reader.fp32(name), "state": state_of}, load_optimizer)
    missing, unexpected = part.module.load_state_dict(reader.buffers(), strict=False)
    param_names = {n for n, _ in params}
    missing = [k for k in missing if k not in param_names]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} buffers do not match the model: missing {missing}, unexpected {unexpected}"
        )
    if load_optimizer and part.optimizer is not None:
        _load_group_hyperparameters(path, part.optimizer.optimizer.param_groups, reader.param_groups())


def _load_group_hyperparameters(path: Path, groups: list[dict], saved: list[dict]) -> None:
    """lr, betas, weight decay... DeepSpeed's engine splits the groups into the dense group(s) and one per ep
    size; ours may group them otherwise (one torch optimizer over every domain). Groups that agree on their
    hyper-parameters carry over whatever the grouping; otherwise the groups must pair up one to one."""
    hyper = [{k: v for k, v in g.items() if k not in ("params", "name", "moe")} for g in saved]
    if all(h == hyper[0] for h in hyper):
        for group in groups:
            group.update({k: v for k, v in hyper[0].items() if k in group})
        return
    kinds = [bool(g.get("moe")) for g in groups], [bool(g.get("moe")) for g in saved]
    if kinds[0] != kinds[1]:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} has optimizer groups {[g.get('name') for g in saved]} of different "
            f"hyper-parameters (moe: {kinds[1]}), which do not pair with this optimizer's groups (moe: {kinds[0]})"
        )
    for group, values in zip(groups, hyper):
        group.update({k: v for k, v in values.items() if k in group})
