"""The `expert_parallel` block (AutoEP): its keys and DeepSpeed's defaults, and the dataclasses AutoEP passes.

The block is parsed into `AutoEPConfig` (DeepSpeed 0.19.8's field names and defaults); validate.py checks it.
`MoEModelPreset` describes a model family (presets.py holds them), `MoELayerSpec` one detected MoE block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

__all__ = [
    "UNSET",
    "AutoEPConfig",
    "MoELayerSpec",
    "MoEModelPreset",
    "fill_autoep_config_from_hf",
    "parse_autoep_config",
]

# "The key was not written" — distinct from None, which for `expert_w3` means "gate and up are fused".
UNSET: Any = type("_Unset", (), {"__repr__": lambda self: "UNSET"})()

# Values the block accepts for its enumerated keys.
SCORE_APPLY = ("auto", "pre", "post")
COMBINE_IMPL = ("auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm")
ROW_WEIGHTING_IMPL = ("auto", "eager", "fused")
GATE_UP_IMPL = ("separate", "fused")
COMM_BACKEND = ("comm", "deepep")
SCORE_FUNC = ("auto", "softmax", "sigmoid")
EXPERT_ACTIVATION_NAMES = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")


def raise_load_balance_coeff(value: object) -> NoReturn:
    """Auxiliary-loss-free balancing (an `expert_bias` updated from token counts) is not built, as in DeepSpeed."""
    raise ValueError(
        f"expert_parallel.load_balance_coeff={value!r} is not supported: it would add an expert_bias for "
        "auxiliary-loss-free load balancing, which AutoEP does not implement. Set load_balance_coeff to null "
        "or omit the key."
    )


@dataclass
class MoEModelPreset:
    """Where a model family keeps its MoE block's parts, and how it routes."""

    moe_layer_pattern: str
    router_pattern: str
    experts_pattern: str
    expert_storage: Literal["fused_3d", "module_list"]
    expert_w1: str
    expert_w2: str
    expert_w3: str | None
    num_experts_attr: str
    top_k_attr: str
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    gate_bias: bool
    has_shared_experts: bool = False
    shared_experts_pattern: str = ""
    shared_experts_gate_pattern: str = ""
    expert_activation: str = "swiglu"
    expert_activation_alpha: float = 1.702
    expert_activation_limit: float = 7.0
    autoep_config_defaults: dict[str, Any] = field(default_factory=dict)
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    hf_model_types: tuple[str, ...] = ()
    unsupported_hf_model_type_notes: dict[str, str] = field(default_factory=dict)
    min_transformers_version: str | None = None
    validated_transformers_versions: str = ""
    docs_support_notes: str = ""


@dataclass
class MoELayerSpec:
    """One detected MoE block: its path in the model and everything needed to rebuild it expert-parallel."""

    moe_module_name: str
    model_family: str
    router_name: str
    experts_name: str
    expert_storage: Literal["fused_3d", "module_list"]
    expert_w1_name: str
    expert_w2_name: str
    expert_w3_name: str | None
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    gate_bias: bool
    return_router_logits: bool
    router_logits_capture_target: Literal["moe_block", "router", "none"]
    router_logits_capture_index: int | None
    router_logits_capture_layer_name: str | None
    has_shared_experts: bool
    shared_experts_name: str
    shared_experts_gate_name: str = ""
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    router_logits_capture_mode: Literal["raw", "post_score"] = "post_score"
    moe_output_shape: Literal["batched", "flat"] = "batched"
    e_score_correction_bias_path: str | None = None
    expert_activation: str = "swiglu"
    expert_activation_alpha: float = 1.702
    expert_activation_limit: float = 7.0


@dataclass
class AutoEPConfig:
    """The `expert_parallel` block, with DeepSpeed 0.19.8's defaults."""

    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    async_split_plan: bool = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: str = "auto"
    combine_impl: str = "auto"
    row_weighting_impl: str = "auto"
    gate_up_impl: str = "separate"
    comm_backend: str = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: str = "auto"
    top_k: int | str = "auto"
    load_balance_coeff: Any = UNSET
    routed_scaling_factor: float | str = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: Any = UNSET
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None
    # Whether `load_balance_coeff` was written (a preset's default then does not replace it).
    _load_balance_coeff_explicit: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._load_balance_coeff_explicit = self.load_balance_coeff is not UNSET
        if self.load_balance_coeff is UNSET:
            self.load_balance_coeff = None


_KEYS = tuple(name for name in AutoEPConfig.__dataclass_fields__ if not name.startswith("_"))


def parse_autoep_config(param_dict: dict | None) -> AutoEPConfig:
    """The `expert_parallel` block as an `AutoEPConfig`; an unknown key or a non-null load_balance_coeff is refused."""
    if not param_dict:
        return AutoEPConfig()
    unknown = sorted(set(param_dict) - set(_KEYS))
    if unknown:
        raise ValueError(f"expert_parallel: unknown key(s) {unknown}; known keys: {list(_KEYS)}")
    if param_dict.get("load_balance_coeff") is not None:
        raise_load_balance_coeff(param_dict["load_balance_coeff"])
    return AutoEPConfig(**param_dict)


def fill_autoep_config_from_hf(config: AutoEPConfig, model_config: object) -> None:
    """Take DeepSeek-style routing settings from the HF model config where the block leaves them unset."""
    if model_config is None:
        return
    if config.num_expert_groups is None:
        config.num_expert_groups = getattr(model_config, "n_group", None)
    if config.num_limited_groups is None:
        config.num_limited_groups = getattr(model_config, "topk_group", None)
    if config.routed_scaling_factor == "auto":
        scale = getattr(model_config, "routed_scaling_factor", None)
        if scale is not None:
            config.route_scale = float(scale)
