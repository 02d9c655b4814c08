"""The model families AutoEP knows (DeepSpeed 0.19.8's registry), and the per-family rules (adapters).

A preset says where a family's MoE block keeps its router and experts and how it routes; an adapter resolves
what depends on the loaded model (its config, its Transformers version, its expert layout). `resolve_preset_
candidates` picks the presets to try: the one the block names, the one the model's `model_type` names, a custom
one built from the block's patterns, or every preset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from shardspeed.moe.autoep.config import UNSET, AutoEPConfig, MoEModelPreset

logger = logging.getLogger(__name__)

__all__ = [
    "PRESET_MODELS",
    "AutoEPPresetAdapter",
    "GroupRoutingConfig",
    "apply_config_overrides",
    "available_preset_names",
    "get_preset",
    "get_preset_adapter",
    "preset_name_for_hf_model_type",
    "resolve_autoep_config_defaults",
    "resolve_preset_candidates",
    "unsupported_preset_for_hf_model_type",
]

_LAYERS = r"model\.layers\.\d+\.mlp"
_FUSED = dict(
    moe_layer_pattern=_LAYERS, router_pattern="gate", experts_pattern="experts", expert_storage="fused_3d",
    expert_w1="gate_up_proj", expert_w2="down_proj", expert_w3=None, top_k_attr="num_experts_per_tok",
    score_apply="post", gate_bias=False, min_transformers_version="5.0.0",
)  # fmt: skip
_NO_BIAS_NOTE = (
    "load_balance_coeff / expert-bias load balancing is not supported; non-null values are refused."
)

PRESET_MODELS: dict[str, MoEModelPreset] = {
    "mixtral": MoEModelPreset(
        **_FUSED, num_experts_attr="num_local_experts", score_func="softmax", route_norm=True,
        preset_adapter="mixtral", hf_model_types=("mixtral",),
    ),
    "qwen3_moe": MoEModelPreset(
        **_FUSED, num_experts_attr="num_experts", score_func="softmax", route_norm=True, has_shared_experts=True,
        shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
        preset_adapter="qwen3_moe", hf_model_types=("qwen3_moe", "qwen2_moe"),
        docs_support_notes="Also covers Qwen2-MoE with the fused expert layout.",
    ),
    "qwen3_5_moe": MoEModelPreset(
        **{**_FUSED, "min_transformers_version": "5.2.0"}, num_experts_attr="num_experts", score_func="softmax",
        route_norm=True, has_shared_experts=True, shared_experts_pattern="shared_expert",
        shared_experts_gate_pattern="shared_expert_gate", preset_adapter="qwen3_5_moe",
        hf_model_types=("qwen3_5_moe_text",),
        unsupported_hf_model_type_notes={
            "qwen3_5_moe": "AutoEP supports the Qwen3.5 text backbone; pass the text-backbone model/config with "
            "model_type='qwen3_5_moe_text'."
        },
    ),
    "deepseek_v2": MoEModelPreset(
        **_FUSED, num_experts_attr="n_routed_experts", score_func="softmax", route_norm=False,
        has_shared_experts=True, shared_experts_pattern="shared_experts",
        autoep_config_defaults={"load_balance_coeff": None}, supports_expert_bias=False,
        preset_adapter="deepseek_v2", hf_model_types=("deepseek_v2",), docs_support_notes=_NO_BIAS_NOTE,
    ),
    "deepseek_v3": MoEModelPreset(
        **_FUSED, num_experts_attr="n_routed_experts", score_func="sigmoid", route_norm=False,
        has_shared_experts=True, shared_experts_pattern="shared_experts",
        autoep_config_defaults={"load_balance_coeff": None}, supports_expert_bias=False,
        preset_adapter="deepseek_v3", hf_model_types=("deepseek_v3",), docs_support_notes=_NO_BIAS_NOTE,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class GroupRoutingConfig:
    """Group-limited routing: experts in `num_expert_groups` groups, tokens choose within `num_limited_groups`."""

    num_expert_groups: int | None
    num_limited_groups: int | None
    group_score_func: str = "top2_sum"


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            raise ValueError(text)
        parts.append(int(digits))
    return tuple(parts)


class AutoEPPresetAdapter:
    """Rules shared by every family; a family overrides the ones it differs in."""

    #: Families whose experts changed layout across Transformers releases check the installed version.
    checks_transformers_version = False

    def validate_compatibility(self, preset_name: str, preset: MoEModelPreset, model_config: Any) -> None:
        model_type = getattr(model_config, "model_type", None)
        if model_type is None:
            return
        note = preset.unsupported_hf_model_type_notes.get(model_type)
        if note is not None:
            supported = ", ".join(repr(value) for value in preset.hf_model_types) or "none"
            raise ValueError(
                f"AutoEP preset '{preset_name}' does not support model_type='{model_type}'. {note} "
                f"Supported HF model_type value(s): {supported}."
            )
        minimum = preset.min_transformers_version
        if not self.checks_transformers_version or minimum is None or model_type not in preset.hf_model_types:
            return
        try:
            installed = self._installed_transformers_version()
        except ImportError as exc:
            raise ValueError(
                f"AutoEP preset '{preset_name}' for model_type='{model_type}' requires Transformers >= {minimum}, "
                f"which cannot be imported: {exc}"
            ) from exc
        try:
            too_old = _version_tuple(installed) < _version_tuple(minimum)
        except ValueError:
            raise ValueError(
                f"AutoEP preset '{preset_name}': cannot read Transformers version {installed!r}"
            ) from None
        if too_old:
            raise ValueError(
                f"AutoEP preset '{preset_name}' for model_type='{model_type}' requires Transformers >= "
                f"{minimum}, but transformers=={installed} is installed (older releases keep experts in "
                "another layout)."
            )

    def _installed_transformers_version(self) -> str:
        import transformers

        return getattr(transformers, "__version__", "unknown")

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config: Any) -> bool:
        if config.route_norm is not None:
            return config.route_norm
        configured = getattr(model_config, "norm_topk_prob", None)
        return bool(configured) if configured is not None else preset.route_norm

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        return GroupRoutingConfig(config.num_expert_groups, config.num_limited_groups)

    def resolve_expert_layout(self, experts_module: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        return preset


class _HFAdapter(AutoEPPresetAdapter):
    checks_transformers_version = True


class _DeepSeekV2Adapter(_HFAdapter):
    """DeepSeek-V2 keeps its own top-k normalisation and uses group routing only with `group_limited_greedy`."""

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config: Any) -> bool:
        return config.route_norm if config.route_norm is not None else preset.route_norm

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        base = super().resolve_group_routing(config, model_config)
        if getattr(model_config, "topk_method", None) != "group_limited_greedy":
            return base
        return GroupRoutingConfig(
            base.num_expert_groups or getattr(model_config, "n_group", None),
            base.num_limited_groups or getattr(model_config, "topk_group", None),
            "max",
        )


class _DeepSeekV3Adapter(_HFAdapter):
    """DeepSeek-V3 always routes by groups when its config has them; its experts may be a ModuleList."""

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        base = super().resolve_group_routing(config, model_config)
        return GroupRoutingConfig(
            base.num_expert_groups or getattr(model_config, "n_group", None),
            base.num_limited_groups or getattr(model_config, "topk_group", None),
            base.group_score_func,
        )

    def resolve_expert_layout(self, experts_module: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        default_fused = preset.expert_storage == "fused_3d" and (
            preset.expert_w1,
            preset.expert_w2,
            preset.expert_w3,
        ) == (
            "gate_up_proj",
            "down_proj",
            None,
        )
        if not isinstance(experts_module, nn.ModuleList) or len(experts_module) == 0 or not default_fused:
            return preset
        first = experts_module[0]
        if not all(
            hasattr(getattr(first, name, None), "weight") for name in ("gate_proj", "up_proj", "down_proj")
        ):
            return preset
        return replace(
            preset,
            expert_storage="module_list",
            expert_w1="gate_proj",
            expert_w2="down_proj",
            expert_w3="up_proj",
        )


_PRESET_ADAPTERS: dict[str, AutoEPPresetAdapter] = {
    "default": AutoEPPresetAdapter(),
    # Mixtral and Qwen3/Qwen2-MoE: detection itself finds whether the experts have the fused layout.
    "mixtral": AutoEPPresetAdapter(),
    "qwen3_moe": AutoEPPresetAdapter(),
    "qwen3_5_moe": _HFAdapter(),
    "deepseek_v2": _DeepSeekV2Adapter(),
    "deepseek_v3": _DeepSeekV3Adapter(),
}


def available_preset_names() -> tuple[str, ...]:
    return tuple(PRESET_MODELS)


def get_preset(preset_name: str) -> MoEModelPreset:
    if preset_name not in PRESET_MODELS:
        raise ValueError(f"Unknown preset_model '{preset_name}'. Available presets: {list(PRESET_MODELS)}")
    return PRESET_MODELS[preset_name]


def get_preset_adapter(adapter_name: str) -> AutoEPPresetAdapter:
    if adapter_name not in _PRESET_ADAPTERS:
        raise ValueError(f"Unknown AutoEP preset adapter '{adapter_name}'")
    return _PRESET_ADAPTERS[adapter_name]


def preset_name_for_hf_model_type(model_type: str) -> str | None:
    return next((name for name, preset in PRESET_MODELS.items() if model_type in preset.hf_model_types), None)


def unsupported_preset_for_hf_model_type(model_type: str) -> tuple[str, MoEModelPreset] | None:
    for name, preset in PRESET_MODELS.items():
        if model_type in preset.unsupported_hf_model_type_notes:
            return name, preset
    return None


def resolve_autoep_config_defaults(config: AutoEPConfig, preset_name: str | None) -> AutoEPConfig:
    """The block with the preset's defaults for the keys the user did not write (only load_balance_coeff has one)."""
    defaults = PRESET_MODELS[preset_name].autoep_config_defaults if preset_name in PRESET_MODELS else {}
    if "load_balance_coeff" not in defaults or config._load_balance_coeff_explicit:
        return config
    resolved = replace(config)
    resolved.load_balance_coeff = defaults["load_balance_coeff"]
    return resolved


# Block key -> preset field it overrides.
_OVERRIDES = {
    "moe_layer_pattern": "moe_layer_pattern", "router_pattern": "router_pattern", "expert_pattern": "experts_pattern",
    "expert_w1": "expert_w1", "expert_w2": "expert_w2", "num_experts_attr": "num_experts_attr",
    "top_k_attr": "top_k_attr", "has_shared_experts": "has_shared_experts",
    "shared_experts_pattern": "shared_experts_pattern", "shared_experts_gate_pattern": "shared_experts_gate_pattern",
    "expert_activation": "expert_activation",
}  # fmt: skip


def apply_config_overrides(config: AutoEPConfig, preset: MoEModelPreset) -> MoEModelPreset:
    """The preset with the block's explicit pattern/name keys written over it (a copy; the registry is unchanged)."""
    overrides = {
        field: getattr(config, key) for key, field in _OVERRIDES.items() if getattr(config, key) is not None
    }
    if config.expert_w3 is not UNSET:
        overrides["expert_w3"] = config.expert_w3
    return replace(preset, **overrides) if overrides else preset


def _custom_preset(config: AutoEPConfig) -> MoEModelPreset:
    return MoEModelPreset(
        moe_layer_pattern=config.moe_layer_pattern,
        router_pattern=config.router_pattern or "gate",
        experts_pattern=config.expert_pattern or "experts",
        expert_storage="fused_3d",
        expert_w1=config.expert_w1 or "gate_up_proj",
        expert_w2=config.expert_w2 or "down_proj",
        expert_w3=None if config.expert_w3 is UNSET else config.expert_w3,
        num_experts_attr=config.num_experts_attr or "num_local_experts",
        top_k_attr=config.top_k_attr or "num_experts_per_tok",
        score_func=config.score_func if config.score_func != "auto" else "softmax",
        score_apply=config.score_apply if config.score_apply != "auto" else "post",
        route_norm=config.route_norm if config.route_norm is not None else True,
        gate_bias=False,
        has_shared_experts=bool(config.has_shared_experts),
        shared_experts_pattern=config.shared_experts_pattern or "",
        shared_experts_gate_pattern=config.shared_experts_gate_pattern or "",
        expert_activation=config.expert_activation or "swiglu",
    )


def _checked(config: AutoEPConfig, name: str, model_config: Any) -> tuple[str, MoEModelPreset]:
    preset = apply_config_overrides(config, get_preset(name))
    get_preset_adapter(preset.preset_adapter).validate_compatibility(name, preset, model_config)
    return name, preset


def resolve_preset_candidates(config: AutoEPConfig, model_config: Any) -> list[tuple[str, MoEModelPreset]]:
    """The presets detection tries, in order: named, then by model_type, then custom patterns, then all."""
    if config.preset_model is not None:
        return [_checked(config, config.preset_model, model_config)]
    model_type = getattr(model_config, "model_type", None)
    if model_type:
        name = preset_name_for_hf_model_type(model_type)
        if name is not None:
            logger.info("AutoEP: model_type=%r uses preset %r", model_type, name)
            return [_checked(config, name, model_config)]
        unsupported = unsupported_preset_for_hf_model_type(model_type)
        if unsupported is not None:
            _checked(config, unsupported[0], model_config)  # raises with the family's note
    if config.moe_layer_pattern:
        return [("custom", _custom_preset(config))]
    return [(name, apply_config_overrides(config, preset)) for name, preset in PRESET_MODELS.items()]
