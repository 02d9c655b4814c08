"""Expert weights from the Hugging Face layouts into this rank's slice of AutoEP's grouped layout.

Rank `r` of `ep_size` owns the contiguous experts `[r * E/ep, (r+1) * E/ep)`. The result is always
`w1` (gate) `[E_local, ffn, hidden]`, `w2` (down) `[E_local, hidden, ffn]`, `w3` (up) `[E_local, ffn, hidden]`,
from either a fused 3D `gate_up_proj` (Transformers 5: `[E, 2*ffn, hidden]`, or `[E, hidden, 2*ffn]`), separate
3D gate/up weights, or a ModuleList of experts with `gate_proj`/`up_proj`/`down_proj` Linears.
Source parameters partitioned by ZeRO-3 are gathered while they are read.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from shardspeed.moe.autoep.config import MoELayerSpec
from shardspeed.moe.autoep.experts import classify_fused_gate_up_layout
from shardspeed.zero.api import GatheredParameters

__all__ = ["gathered_sources", "repack_expert_requires_grad_flags", "repack_expert_weights"]


def _is_partitioned(param: object) -> bool:
    return torch.is_tensor(param) and (
        hasattr(param, "ds_id") or getattr(param, "_shardspeed_unit", None) is not None
    )


@contextmanager
def gathered_sources(params):
    """Full values of the ZeRO-3 parameters among `params` inside the block (read-only: changes are dropped)."""
    partitioned = [param for param in params if _is_partitioned(param)]
    if not partitioned:
        yield
        return
    # Looked up at call time so the module's GatheredParameters is the one used (and can be replaced in tests).
    with GatheredParameters(partitioned, modifier_rank=None, enabled=True):
        yield


def local_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    weight = getattr(module, name, None)
    if isinstance(weight, nn.Module):
        weight = getattr(weight, "weight", None)
    if not torch.is_tensor(weight):
        raise ValueError(f"expert module {type(module).__name__} has no weight '{name}'")
    return weight


def _expert_sources(experts: nn.Module, spec: MoELayerSpec, start: int, end: int) -> list[torch.Tensor]:
    names = [spec.expert_w1_name, spec.expert_w2_name] + (
        [spec.expert_w3_name] if spec.expert_w3_name else []
    )
    if spec.expert_storage == "fused_3d":
        return [_weight(experts, name) for name in names]
    if spec.expert_storage == "module_list":
        return [_weight(experts[index], name) for index in range(start, end) for name in names]
    raise ValueError(f"Unknown expert_storage type: {spec.expert_storage}")


def _stack_module_list(experts: nn.Module, spec: MoELayerSpec, start: int, end: int) -> tuple:
    """Every expert is gathered in global order, one at a time, though only [start, end) are kept: gathering is
    collective under ZeRO-3, so every rank must gather the same parameters in the same order."""
    if not spec.expert_w3_name:
        raise ValueError("module_list experts need separate gate (expert_w1) and up (expert_w3) weights")
    names = (spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name)
    kept: list[list[torch.Tensor]] = [[], [], []]
    for index in range(len(experts)):
        weights = [_weight(experts[index], name) for name in names]
        with gathered_sources(weights):
            if start <= index < end:
                for role, weight in enumerate(weights):
                    kept[role].append(weight.data.detach().clone())
    for role, name in enumerate(names):
        kinds = {(w.dtype, w.device) for w in kept[role]}
        if len(kinds) != 1:
            raise ValueError(
                f"AutoEP cannot stack the '{name}' weights of layer '{spec.moe_module_name}': mixed dtype/device "
                f"{sorted(str(k) for k in kinds)}; cast the experts to one dtype and device first"
            )
    return tuple(torch.stack(role) for role in kept)


def repack_expert_weights(experts_source: nn.Module, spec: MoELayerSpec, ep_rank: int, ep_size: int) -> tuple:
    """`(w1, w2, w3)` of this rank's experts, fresh tensors in the source's dtype and device."""
    start, end = local_expert_range(spec.num_experts, ep_rank, ep_size)
    if spec.expert_storage == "module_list":
        return _stack_module_list(experts_source, spec, start, end)
    sources = _expert_sources(experts_source, spec, start, end)
    with gathered_sources(sources):
        w1_all, w2_all = sources[0].data[start:end], sources[1].data[start:end]
        if spec.expert_w3_name is not None:
            return w1_all.clone(), w2_all.clone(), sources[2].data[start:end].clone()
        layout = classify_fused_gate_up_layout(tuple(w1_all.shape), tuple(w2_all.shape))
        if layout is None:
            raise ValueError(
                f"Unsupported fused expert weight layout for AutoEP: {spec.expert_w1_name}={tuple(w1_all.shape)}, "
                f"{spec.expert_w2_name}={tuple(w2_all.shape)}"
            )
        ffn = layout.ffn_hidden_size
        if layout.needs_transpose:  # [E, hidden, 2*ffn] / [E, ffn, hidden]
            w1_all, w2_all = w1_all.transpose(1, 2), w2_all.transpose(1, 2)
        return (
            w1_all[:, :ffn].contiguous().clone(),
            w2_all.contiguous().clone(),
            w1_all[:, ffn:].contiguous().clone(),
        )


def repack_expert_requires_grad_flags(
    experts_source: nn.Module, spec: MoELayerSpec, ep_rank: int, ep_size: int
):
    """`requires_grad` of `(w1, w2, w3)`: each the source's; mixed flags within one stacked weight are refused."""
    start, end = local_expert_range(spec.num_experts, ep_rank, ep_size)
    sources = _expert_sources(experts_source, spec, start, end)
    if spec.expert_storage == "fused_3d":
        flags = [bool(w.requires_grad) for w in sources]
        return flags[0], flags[1], flags[2] if len(flags) == 3 else flags[0]
    result = []
    for role, group in zip((spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name), (0, 1, 2)):
        flags = {bool(w.requires_grad) for w in sources[group::3]}
        if len(flags) != 1:
            raise ValueError(
                f"AutoEP cannot stack the '{role}' weights of layer '{spec.moe_module_name}': mixed requires_grad "
                "flags (some frozen, some trainable); freeze or unfreeze this rank's experts together"
            )
        result.append(flags.pop())
    return tuple(result)
