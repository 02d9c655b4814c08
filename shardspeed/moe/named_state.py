"""A model with MoE layers seen by parameter name, as its checkpoints need it: this rank's experts under their
global index (`expert_entries`; AutoEP's stacked experts: autoep_checkpoint.py), and setting one parameter's whole fp32 value and optimizer state
(`set_full_state`) whichever ZeRO stage holds it. Shared by our own MoE checkpoints (checkpoint.py) and the
loading of DeepSpeed's (deepspeed_checkpoint.py).
"""

from __future__ import annotations

import torch

from shardspeed.zero.api import safe_set_full_fp32_param

__all__ = ["expert_entries", "is_managed", "set_full_state"]


def expert_entries(part):
    """(layer id, global expert id, expert module, {global name: local name}, local name prefix) for this
    rank's experts, the layer id counting MoE layers in module order (as DeepSpeed numbers them), and expert
    `p * n + l` being local expert l of expert-parallel rank p (n local experts per rank)."""
    from shardspeed.moe.autoep_checkpoint import moe_layer_ids
    from shardspeed.moe.layer import MoE

    for layer_id, prefix, module in moe_layer_ids(part.module):  # AutoEP layers count too (their own files)
        if not isinstance(module, MoE):
            continue
        ep_rank = part.moe.expert_rank(module.expert_group_name)
        base = (prefix + "." if prefix else "") + "deepspeed_moe.experts.deepspeed_experts"
        for local, expert in enumerate(module.deepspeed_moe.experts.deepspeed_experts):
            global_id = ep_rank * module.num_local_experts + local
            names = {f"{base}.{global_id}.{n}": f"{base}.{local}.{n}" for n in expert.state_dict()}
            yield layer_id, global_id, expert, names, f"{base}.{local}."


def is_managed(p) -> bool:
    """A trainable parameter that an optimizer wrapper holds (its fp32 master and state live there)."""
    return p.requires_grad and getattr(p, "_shardspeed_zero", None) is not None


def set_full_state(param, entry: dict, load_optimizer: bool) -> None:
    """Set `param`, its fp32 master and (with `load_optimizer`) its optimizer state from its whole values,
    `entry` = {"fp32": value, "state": {key: value in the parameter's shape, or a scalar}} (collective over
    the parameter's group at stage 3)."""
    safe_set_full_fp32_param(param, entry["fp32"].to(param.device))
    if not load_optimizer:
        return
    wrapper, index = param._shardspeed_zero
    if index is None:
        tensor = wrapper.masters.get(param, param)
        target = wrapper.optimizer.state.setdefault(tensor, {})
        for key, value in entry["state"].items():
            target[key] = value.to(tensor.device).clone() if torch.is_tensor(value) else value
        return
    bucket, master = wrapper.buckets[index], wrapper.masters[index]
    target = wrapper.optimizer.state.setdefault(master, {})
    position = next(i for i, p in enumerate(bucket.params) if p is param)
    for key, value in entry["state"].items():
        if not torch.is_tensor(value) or value.dim() == 0:
            target[key] = value.clone() if torch.is_tensor(value) else value
            continue
        if key not in target or target[key].shape != master.shape:
            target[key] = torch.zeros_like(master)
        flat = value.reshape(-1).to(master.device)
        for i, _, in_param, in_shard, length in bucket.fragments():
            if i == position:
                target[key][in_shard : in_shard + length].copy_(flat[in_param : in_param + length])
