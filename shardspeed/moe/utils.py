"""Telling expert parameters from the rest, and optimizer parameter groups that keep them apart."""

from __future__ import annotations

from torch import nn

__all__ = [
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def is_moe_param(param) -> bool:
    """True for a parameter of an MoE layer's experts (tagged `allreduce = False` by `Experts`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def has_moe_layers(module: nn.Module) -> tuple[bool, list[int]]:
    """(whether `module` holds MoE layers, their num_experts in module order)."""
    from shardspeed.moe.layer import MoE

    counts = [m.num_experts for m in module.modules() if isinstance(m, MoE)]
    return bool(counts), counts


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """The gradients of `group`'s parameters that have one, shared first, then expert."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups, max_group_size=178956971
) -> list[dict]:
    """Split each parameter group (a dict, a list/tuple of dicts, or a bare iterable of parameters) into its
    dense part and one group per expert group name, each marked `moe: True` and `name: <group name>`;
    groups of more than `max_group_size` elements are cut into several."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, (list, tuple)) or not all(isinstance(g, dict) for g in param_groups):
        param_groups = [{"params": list(param_groups)}]
    result: list[dict] = []
    for group in param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        params = list(group["params"])
        dense = [p for p in params if not is_moe_param(p)]
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        result.append({**options, "params": dense})
        for name, members in by_name.items():
            for chunk in _cut(members, max_group_size):
                result.append({**options, "moe": True, "name": name, "params": chunk})
    return result


def _cut(params: list, max_numel: int) -> list[list]:
    chunks, current, numel = [], [], 0
    for p in params:
        if current and numel + p.numel() > max_numel:
            chunks.append(current)
            current, numel = [], 0
        current.append(p)
        numel += p.numel()
    return chunks + ([current] if current else [])
