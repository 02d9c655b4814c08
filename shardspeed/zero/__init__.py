"""ZeRO: partitioned optimizer state (stage 1), gradients (stage 2) and parameters (stage 3).

User-facing names as DeepSpeed's `deepspeed.zero`.
"""

from shardspeed.core.partitioned import ZeroParamStatus, ZeroParamType
from shardspeed.zero.api import (
    GatheredParameters,
    register_external_parameter,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    unregister_external_parameter,
    unwrap_model_for_generation,
)
from shardspeed.zero.init import Init

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
