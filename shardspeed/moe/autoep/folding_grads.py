"""Gradient corrections for folded AutoEP layers whose tokens are split across tensor lanes and restored by
an all-gather (DeepSpeed 0.19.8's parameter families of `module_inject.auto_ep_folding`).

`ep_tp_dispatch.restore_combined` rebuilds every lane's share of the routed outputs on every lane; its
backward sums the lanes' (identical) output gradients, so whatever sits before it receives `tp_size` times
the gradient of its own share. A parameter's family says how its gradient is put right over the tensor group:

| family | strategy |
|---|---|
| tensor-sharded (`model_parallel` / `tensor_model_parallel` marks) | "skip": AutoTP owns it |
| routed expert (`allreduce = False`) | "expert_tp_cancel": divide by tp (no exchange: the experts are not replicated) |
| router marked partial (`mark_autoep_folding_partial_router_parameter`) | "sum" over the tensor group |
| SP-sharded LayerNorm (`mark_autoep_folding_sp_sharded_layernorm_parameter`) with mp_mode "sp" | "sum" |
| anything else (router marked replicated, dense, LayerNorm) | "average" over the tensor group |

These are the corrections a caller composing `partition_assignments` / `restore_combined` needs. The engine's
own folded layer (folded_layer.py) corrects the router inside the layer instead and scales the experts in
their reduction domain, so it does not call these per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "AUTOEP_FOLDING_GRAD_CORRECTED_ATTR",
    "AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE",
    "AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL",
    "AUTOEP_FOLDING_GRAD_REDUCE_SKIP",
    "AUTOEP_FOLDING_GRAD_REDUCE_SUM",
    "AUTOEP_FOLDING_PARAM_FAMILY_ATTR",
    "AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM",
    "AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM",
    "AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM",
    "apply_folding_correction_to_grad_buffer",
    "autoep_folding_gradient_reduction_strategy",
    "clear_autoep_folding_gradient_corrected",
    "is_autoep_folding_gradient_corrected",
    "mark_autoep_folding_partial_router_parameter",
    "mark_autoep_folding_router_parameter",
    "mark_autoep_folding_sp_sharded_layernorm_parameter",
    "reduce_autoep_folding_gradient",
]

AUTOEP_FOLDING_PARAM_FAMILY_ATTR = "ds_autoep_folding_param_family"
AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM = "router_gate_replicated"
AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM = "router_gate_partial"
AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM = "sp_sharded_layernorm"
AUTOEP_FOLDING_GRAD_CORRECTED_ATTR = "ds_autoep_folding_grad_corrected"
AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"


def mark_autoep_folding_router_parameter(param) -> None:
    """The router runs on every lane and its share is restored on every lane: its gradient is averaged."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM)


def mark_autoep_folding_partial_router_parameter(param) -> None:
    """A router whose per-lane gradient is a genuine part of the whole (never restored): summed."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM)


def mark_autoep_folding_sp_sharded_layernorm_parameter(param) -> None:
    """A LayerNorm over a sequence-sharded activation: summed under mp_mode "sp", averaged otherwise."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM)


def _family(param, param_name: str | None) -> str | None:
    family = getattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, None)
    if family is None and param_name is not None and ".router." in param_name:
        return AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM  # an unmarked router: the safe (replicated) family
    return family


def autoep_folding_gradient_reduction_strategy(folding_spec, param, *, param_name: str | None = None) -> str:
    """The strategy (the table in the module docstring) for `param` under `folding_spec` (None or tp 1: skip)."""
    if folding_spec is None or getattr(folding_spec, "tp_size", 1) <= 1:
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if hasattr(param, "allreduce") and not param.allreduce:
        return AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL
    family = _family(param, param_name)
    mode = getattr(folding_spec, "mp_mode", "tp")
    if family == AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM and mode in ("tp", "sp"):
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    if family == AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM and mode == "sp":
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    return AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE


def reduce_autoep_folding_gradient(
    folding_spec, param, grad, *, tp_group, param_name: str | None = None
) -> str:
    """Correct `grad` (in place) by `param`'s strategy over `tp_group`; return the strategy. A sparse or
    missing gradient is left alone. Low-precision gradients are summed in fp32 (no bf16 rounding per lane)."""
    strategy = autoep_folding_gradient_reduction_strategy(folding_spec, param, param_name=param_name)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_SKIP or grad is None or grad.is_sparse:
        return strategy
    data = grad.data
    lanes = dist.get_world_size(group=tp_group)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL:
        if lanes > 1:
            data.div_(lanes)
        return strategy
    total = data if data.dtype == torch.float32 else data.float()
    dist.all_reduce(total, group=tp_group)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE:
        total.div_(lanes)
    if total is not data:
        data.copy_(total)
    return strategy


def is_autoep_folding_gradient_corrected(param) -> bool:
    return bool(getattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, False))


def clear_autoep_folding_gradient_corrected(param) -> None:
    if hasattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR):
        setattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, False)


def apply_folding_correction_to_grad_buffer(
    folding_spec,
    param,
    grad,
    *,
    tp_group,
    param_name: str | None = None,
    use_correction_marker: bool = True,
) -> str:
    """`reduce_autoep_folding_gradient` at most once per accumulation window: with the marker, a parameter
    already corrected (until `clear_autoep_folding_gradient_corrected`) is skipped, since the expert
    cancellation is not idempotent."""
    if use_correction_marker and is_autoep_folding_gradient_corrected(param):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    strategy = reduce_autoep_folding_gradient(
        folding_spec, param, grad, tp_group=tp_group, param_name=param_name
    )
    if use_correction_marker and strategy != AUTOEP_FOLDING_GRAD_REDUCE_SKIP:
        setattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, True)
    return strategy
