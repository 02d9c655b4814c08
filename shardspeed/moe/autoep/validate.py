"""Checks of the `expert_parallel` block: `validate_autoep_config` from the block and the topology alone,
`validate_autoep_post_detection` against each detected MoE block. Every refused value names its key.
"""

from __future__ import annotations

from shardspeed.moe.autoep.config import (
    COMBINE_IMPL,
    COMM_BACKEND,
    EXPERT_ACTIVATION_NAMES,
    GATE_UP_IMPL,
    ROW_WEIGHTING_IMPL,
    SCORE_APPLY,
    SCORE_FUNC,
    UNSET,
    AutoEPConfig,
    MoELayerSpec,
    raise_load_balance_coeff,
)
from shardspeed.moe.autoep.folding import build_folding_spec, validate_folding_global
from shardspeed.moe.autoep.presets import PRESET_MODELS

__all__ = ["validate_autoep_config", "validate_autoep_post_detection"]


def _check_choice(key: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"expert_parallel.{key} must be one of {allowed}, got {value!r}")


def _check_attr_name(key: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"expert_parallel.{key} must be a non-empty string")
    if "." in value:
        raise ValueError(f"expert_parallel.{key} must be a direct attribute name (no dots), got {value!r}")


def _check_topology(
    config: AutoEPConfig, world_size: int, pp_size: int, tp_size: int, sp_size: int, **folding
) -> None:
    """Expert-parallel groups are carved out of one pipeline stage's ranks, tensor-parallel ranks folded in
    (folding.py): the sizes must tile the stage, and a folded layout must pass its own checks."""
    size = config.autoep_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"expert_parallel.autoep_size must be a positive integer, got {size!r}")
    spec = build_folding_spec(
        world_size=world_size, pp_size=max(pp_size, 1), tp_size=max(tp_size, 1), ep_size=size,
        etp_size=config.expert_tensor_parallel_size, mp_mode="tp" if tp_size > 1 else "sp",
    )  # fmt: skip
    validate_folding_global(spec, sp_size=sp_size, ep_preset=config.preset_model, **folding)


def validate_autoep_config(
    config: AutoEPConfig,
    world_size: int,
    pp_size: int,
    tp_size: int,
    sp_size: int,
    *,
    zero_stage: int = 0,
    deepcompile_enabled: bool = False,
    tp_preset_model: str | None = None,
    use_data_before_expert_parallel: bool = False,
    mpu=None,
    zero_offload_optimizer: bool = False,
    zero_offload_param: bool = False,
) -> None:
    """Check the block against itself and the topology; raise ValueError naming the key at fault."""
    if config.load_balance_coeff is not None:
        raise_load_balance_coeff(config.load_balance_coeff)
    for key in ("validate_folding_routing", "async_split_plan"):
        if not isinstance(getattr(config, key), bool):
            raise ValueError(f"expert_parallel.{key} must be a boolean")
    if not config.enabled:
        return
    if use_data_before_expert_parallel:
        raise ValueError(
            "use_data_before_expert_parallel_=True is not supported: expert-parallel groups are consecutive "
            "data-parallel ranks"
        )
    if config.async_split_plan:
        raise ValueError("expert_parallel.async_split_plan overlaps a CUDA copy stream; it is not built")
    _check_topology(
        config, world_size, pp_size, tp_size, sp_size, deepcompile_enabled=deepcompile_enabled,
        tp_preset=tp_preset_model, mpu=mpu, zero_offload_optimizer=zero_offload_optimizer,
        zero_offload_param=zero_offload_param,
    )  # fmt: skip
    if config.preset_model is not None and config.preset_model not in PRESET_MODELS:
        raise ValueError(
            f"Unknown preset_model {config.preset_model!r}. Available presets: {list(PRESET_MODELS)}"
        )
    _check_values(config)
    rsf = config.routed_scaling_factor
    if rsf != "auto" and (isinstance(rsf, bool) or not isinstance(rsf, (int, float))):
        raise ValueError("expert_parallel.routed_scaling_factor must be a number or 'auto'")


def _check_values(config: AutoEPConfig) -> None:
    """The enumerated keys, the group sizes and the attribute-name keys."""
    _check_choice("score_apply", config.score_apply, SCORE_APPLY)
    _check_choice("combine_impl", config.combine_impl, COMBINE_IMPL)
    _check_choice("row_weighting_impl", config.row_weighting_impl, ROW_WEIGHTING_IMPL)
    _check_choice("gate_up_impl", config.gate_up_impl, GATE_UP_IMPL)
    _check_choice("comm_backend", config.comm_backend, COMM_BACKEND)
    _check_choice("score_func", config.score_func, SCORE_FUNC)
    _check_not_built(config)
    if config.expert_activation is not None:
        _check_choice("expert_activation", config.expert_activation, EXPERT_ACTIVATION_NAMES)
    if config.num_limited_groups is not None and config.num_limited_groups < 1:
        raise ValueError(f"num_limited_groups must be >= 1, got {config.num_limited_groups}")
    if config.num_expert_groups is not None:
        if config.num_expert_groups < 1:
            raise ValueError(f"num_expert_groups must be >= 1, got {config.num_expert_groups}")
        if config.num_limited_groups is not None and config.num_limited_groups > config.num_expert_groups:
            raise ValueError(
                f"num_limited_groups ({config.num_limited_groups}) must be <= "
                f"num_expert_groups ({config.num_expert_groups})"
            )
    for key in (
        "expert_w1",
        "expert_w2",
        "num_experts_attr",
        "top_k_attr",
        "router_pattern",
        "expert_pattern",
    ):
        _check_attr_name(key, getattr(config, key))
    for key in ("shared_experts_pattern", "shared_experts_gate_pattern"):
        _check_attr_name(key, getattr(config, key))
    if config.expert_w3 is not UNSET:
        _check_attr_name("expert_w3", config.expert_w3)
    if config.has_shared_experts is not None and not isinstance(config.has_shared_experts, bool):
        raise ValueError("expert_parallel.has_shared_experts must be a boolean when set")
    if config.top_k != "auto" and (not isinstance(config.top_k, int) or config.top_k < 1):
        raise ValueError(f"expert_parallel.top_k must be a positive integer or 'auto', got {config.top_k!r}")


def _check_not_built(config: AutoEPConfig) -> None:
    """Values whose meaning is a CUDA kernel or a GPU library this project does not build are refused by name."""
    if config.comm_backend == "deepep":
        raise ValueError('expert_parallel.comm_backend="deepep" needs the DeepEP CUDA library; use "comm"')
    if config.combine_impl == "fused_weighted_sum":
        raise ValueError(
            'expert_parallel.combine_impl="fused_weighted_sum" is a Triton kernel that is not built'
        )
    if config.row_weighting_impl == "fused":
        raise ValueError(
            'expert_parallel.row_weighting_impl="fused" runs only inside DeepEP, which is not built'
        )
    if config.gate_up_impl == "fused" and not config.use_grouped_mm:
        raise ValueError('expert_parallel.gate_up_impl="fused" needs use_grouped_mm=true')
    # DeepEP's buffer settings: they mean something only to the DeepEP backend, refused above.
    for key, default in (("comm_num_sm", 12), ("comm_qp_margin", 4), ("comm_max_tokens_per_rank", 0)):
        if getattr(config, key) != default:
            raise ValueError(
                f"expert_parallel.{key}={getattr(config, key)!r} sizes DeepEP's buffers, and DeepEP is not built "
                f"(comm_backend 'comm' has no such setting); leave it at {default}"
            )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_autoep_post_detection(config: AutoEPConfig, specs: list[MoELayerSpec]) -> None:
    """Check the expert-parallel size and group-limited routing against each detected layer."""
    if not config.enabled:
        return
    for spec in specs:
        name, experts, size = spec.moe_module_name, spec.num_experts, config.autoep_size
        if size > experts:
            raise ValueError(
                f"autoep_size={size} exceeds num_experts={experts} in layer '{name}': each rank must own at "
                f"least one expert. Valid autoep_size values: {_divisors(experts)}"
            )
        if experts % size:
            raise ValueError(
                f"num_experts={experts} in layer '{name}' is not divisible by autoep_size={size}. "
                f"Valid autoep_size values: {_divisors(experts)}"
            )
        groups = spec.num_expert_groups if spec.num_expert_groups is not None else config.num_expert_groups
        limited = (
            spec.num_limited_groups if spec.num_limited_groups is not None else config.num_limited_groups
        )
        if limited is not None and groups is None:
            raise ValueError(f"num_limited_groups requires num_expert_groups to be set in layer '{name}'")
        if groups is None:
            continue
        if groups < 1 or experts % groups:
            raise ValueError(
                f"num_expert_groups ({groups}) must divide num_experts ({experts}) in layer '{name}'"
            )
        if limited is None or not 1 <= limited <= groups:
            raise ValueError(
                f"num_limited_groups ({limited}) must be set, >= 1 and <= num_expert_groups ({groups}) "
                f"in layer '{name}'"
            )
