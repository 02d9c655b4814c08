"""`AutoEP`: find a model's MoE blocks (`ep_parser`) and replace them by `AutoEPMoELayer`s (`replace_moe_layer`).

A block is a module whose path fully matches the preset's `moe_layer_pattern` and that has the preset's router
child and an experts child holding expert weights (3D tensors, or a ModuleList). The expert count comes from
the router weight's rows (checked against the model config), top-k from the config (or the block's `top_k`),
sizes from the expert weights; routing settings from the block, else the model config, else the preset.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch
from torch import nn

from shardspeed.moe.autoep.config import (
    AutoEPConfig,
    MoELayerSpec,
    MoEModelPreset,
    fill_autoep_config_from_hf,
)
from shardspeed.moe.autoep.experts import classify_fused_gate_up_layout
from shardspeed.moe.autoep.layer import AutoEPMoELayer
from shardspeed.moe.autoep.presets import (
    get_preset_adapter,
    preset_name_for_hf_model_type,
    resolve_preset_candidates,
    unsupported_preset_for_hf_model_type,
)

logger = logging.getLogger(__name__)

__all__ = ["AutoEP", "resolve_route_scale"]


def _shape(param: torch.Tensor) -> torch.Size:
    """The full shape, also of a ZeRO-3 partitioned parameter (whose `.data` is empty)."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def _as_finite_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def resolve_route_scale(config: AutoEPConfig, model_config: Any) -> float:
    """The one scale on routing weights: the block's routed_scaling_factor, else the model's, else route_scale."""
    if config.routed_scaling_factor != "auto":
        return _as_finite_float(config.routed_scaling_factor, "routed_scaling_factor")
    from_model = getattr(model_config, "routed_scaling_factor", None)
    if from_model is not None:
        return _as_finite_float(from_model, "model.config.routed_scaling_factor")
    return _as_finite_float(config.route_scale, "route_scale")


def _has_3d_weight(module: nn.Module, name: str) -> bool:
    weight = getattr(module, name, None)
    return torch.is_tensor(weight) and len(_shape(weight)) == 3


def _sizes(experts: nn.Module, preset: MoEModelPreset, storage: str) -> tuple[int, int]:
    """(hidden_size, ffn_hidden_size) read from the expert weights."""
    if storage == "module_list":
        w1 = getattr(experts[0], preset.expert_w1, None)
        if isinstance(w1, nn.Linear):
            return w1.in_features, w1.out_features
        if torch.is_tensor(w1) and len(_shape(w1)) == 2:
            return _shape(w1)[1], _shape(w1)[0]
        raise ValueError(f"expert weight '{preset.expert_w1}' not found on the first expert")
    w1_shape = tuple(_shape(getattr(experts, preset.expert_w1)))
    w2 = getattr(experts, preset.expert_w2, None)
    if w2 is None:
        raise ValueError(f"experts module has no '{preset.expert_w2}'")
    if preset.expert_w3 is not None:
        if getattr(experts, preset.expert_w3, None) is None:
            raise ValueError(
                f"expert_w3='{preset.expert_w3}' is set but the experts module has no such weight"
            )
        return w1_shape[2], w1_shape[1]
    layout = classify_fused_gate_up_layout(w1_shape, tuple(_shape(w2)))
    if layout is None:
        raise ValueError(
            f"expert_w3=None expects fused gate+up weights, [E, 2*ffn, hidden]/[E, hidden, ffn] or "
            f"[E, hidden, 2*ffn]/[E, ffn, hidden], got {preset.expert_w1}={w1_shape}, "
            f"{preset.expert_w2}={tuple(_shape(w2))}"
        )
    return layout.hidden_size, layout.ffn_hidden_size


def _correction_bias_path(block: nn.Module, name: str) -> str | None:
    paths = [
        path
        for path, sub in block.named_modules()
        if getattr(sub, "e_score_correction_bias", None) is not None
    ]
    if len(paths) > 1:
        raise ValueError(f"AutoEP found e_score_correction_bias in several places in layer '{name}': {paths}")
    return paths[0] if paths else None


def _output_contract(block: nn.Module, router: nn.Module) -> dict:
    """Whether the source block returns router logits (Transformers' `_can_record_outputs` on the block)."""
    contract = dict(
        return_router_logits=False, router_logits_capture_target="none", router_logits_capture_index=None,
        router_logits_capture_layer_name=None,
    )  # fmt: skip
    if hasattr(type(router), "_can_record_outputs"):
        contract.update(router_logits_capture_target="router", router_logits_capture_index=0)
    if getattr(block, "_can_record_outputs", None):
        contract.update(return_router_logits=True, router_logits_capture_target="moe_block")
    return contract


class AutoEP:
    """Detects and replaces one model's MoE blocks, configured by an `AutoEPConfig`."""

    def __init__(self, model: nn.Module, config: AutoEPConfig) -> None:
        self.model = model
        self.config = config
        self.model_config = getattr(model, "config", None)
        fill_autoep_config_from_hf(self.config, self.model_config)

    def _resolve_presets(self) -> list[tuple[str, MoEModelPreset]]:
        return resolve_preset_candidates(self.config, self.model_config)

    def _requires_detection(self) -> bool:
        """Finding nothing is an error when the user (or the model's type) named what to find."""
        if self.config.preset_model is not None or self.config.moe_layer_pattern is not None:
            return True
        model_type = getattr(self.model_config, "model_type", None)
        return model_type is not None and (
            preset_name_for_hf_model_type(model_type) is not None
            or unsupported_preset_for_hf_model_type(model_type) is not None
        )

    def ep_parser(self) -> list[MoELayerSpec]:
        """One `MoELayerSpec` per MoE block found, in module order."""
        presets = self._resolve_presets()
        specs = []
        for preset_name, preset in presets:
            pattern = re.compile(preset.moe_layer_pattern)
            for name, module in self.model.named_modules():
                if pattern.fullmatch(name):
                    spec = self._spec(name, module, preset_name, preset)
                    if spec is not None:
                        specs.append(spec)
        if not specs and self._requires_detection():
            expected = "; ".join(
                f"{n}: moe_layer_pattern='{p.moe_layer_pattern}', router='{p.router_pattern}', "
                f"experts='{p.experts_pattern}'"
                for n, p in presets
            )
            raise ValueError(f"AutoEP: no MoE layers detected. Expected MoE structure: {expected}")
        names = [spec.moe_module_name for spec in specs]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(
                f"AutoEP detection is ambiguous: several presets match {duplicated}; set expert_parallel.preset_model"
            )
        return specs

    def _spec(
        self, name: str, block: nn.Module, preset_name: str, preset: MoEModelPreset
    ) -> MoELayerSpec | None:
        adapter = get_preset_adapter(preset.preset_adapter)
        experts = getattr(block, preset.experts_pattern, None)
        router = getattr(block, preset.router_pattern, None)
        if experts is None or router is None:
            return None  # a dense MLP under the same path
        layout = adapter.resolve_expert_layout(experts, preset)
        if _has_3d_weight(experts, layout.expert_w1):
            storage = "fused_3d"
        elif isinstance(experts, nn.ModuleList) and len(experts):
            storage = "module_list"
        else:
            return None
        cfg, model_cfg = self.config, self.model_config
        num_experts = getattr(model_cfg, preset.num_experts_attr, None)
        router_weight = getattr(router, "weight", None)
        if router_weight is not None and len(_shape(router_weight)) == 2:
            rows = _shape(router_weight)[0]
            if num_experts is not None and num_experts != rows:
                raise ValueError(
                    f"Config num_experts={num_experts} mismatches router weight rows {rows} in '{name}'"
                )
            num_experts = rows
        if num_experts is None:
            raise ValueError(
                f"Could not determine num_experts for layer '{name}'; set model.config.{preset.num_experts_attr}"
            )
        top_k = cfg.top_k if isinstance(cfg.top_k, int) else getattr(model_cfg, preset.top_k_attr, None)
        if top_k is None:
            top_k = getattr(block, "top_k", None)
        if top_k is None:
            raise ValueError(
                f"Could not determine top_k for layer '{name}'; set model.config.{preset.top_k_attr}"
            )
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts} in layer '{name}'")
        hidden, ffn = _sizes(experts, layout, storage)
        if router_weight is not None and hidden != _shape(router_weight)[1]:
            raise ValueError(f"hidden_size={hidden} from expert weights mismatches the router's in '{name}'")
        score_func = cfg.score_func
        if score_func == "auto":
            from_model = getattr(model_cfg, "scoring_func", None)
            score_func = from_model if from_model in ("softmax", "sigmoid") else preset.score_func
        groups = adapter.resolve_group_routing(cfg, model_cfg)
        shared = (
            preset.has_shared_experts
            and getattr(block, preset.shared_experts_pattern or "-", None) is not None
        )
        shared_gate = (
            shared
            and bool(preset.shared_experts_gate_pattern)
            and (getattr(block, preset.shared_experts_gate_pattern, None) is not None)
        )
        return MoELayerSpec(
            moe_module_name=name, model_family=preset_name, router_name=preset.router_pattern,
            experts_name=preset.experts_pattern, expert_storage=storage, expert_w1_name=layout.expert_w1,
            expert_w2_name=layout.expert_w2, expert_w3_name=layout.expert_w3, num_experts=num_experts, top_k=top_k,
            hidden_size=hidden, ffn_hidden_size=ffn, score_func=score_func,
            score_apply=cfg.score_apply if cfg.score_apply != "auto" else preset.score_apply,
            route_norm=adapter.resolve_route_norm(cfg, preset, model_cfg),
            gate_bias=getattr(router, "bias", None) is not None if router_weight is not None else preset.gate_bias,
            has_shared_experts=shared, shared_experts_name=preset.shared_experts_pattern if shared else "",
            shared_experts_gate_name=preset.shared_experts_gate_pattern if shared_gate else "",
            route_scale=resolve_route_scale(cfg, model_cfg), num_expert_groups=groups.num_expert_groups,
            num_limited_groups=groups.num_limited_groups, group_score_func=groups.group_score_func,
            supports_expert_bias=preset.supports_expert_bias,
            unsupported_router_bias_names=preset.unsupported_router_bias_names,
            preset_adapter=preset.preset_adapter, e_score_correction_bias_path=_correction_bias_path(block, name),
            expert_activation=layout.expert_activation, expert_activation_alpha=layout.expert_activation_alpha,
            expert_activation_limit=layout.expert_activation_limit, **_output_contract(block, router),
        )  # fmt: skip

    def replace_moe_layer(self, spec: MoELayerSpec, ep_size: int, ep_rank: int) -> AutoEPMoELayer:
        """Swap the block at `spec.moe_module_name` for its `AutoEPMoELayer` (this rank's experts only)."""
        parent_path, _, child = spec.moe_module_name.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        replacement = AutoEPMoELayer(spec, getattr(parent, child), ep_size, ep_rank, self.config)
        setattr(parent, child, replacement)
        logger.info(
            "AutoEP: replaced '%s' (ep_size=%d, ep_rank=%d, local experts=%d)",
            spec.moe_module_name, ep_size, ep_rank, replacement.num_local_experts,
        )  # fmt: skip
        return replacement

    def replace_moe_layers(
        self, specs: list[MoELayerSpec], ep_size: int, ep_rank: int
    ) -> list[AutoEPMoELayer]:
        return [self.replace_moe_layer(spec, ep_size, ep_rank) for spec in specs]
