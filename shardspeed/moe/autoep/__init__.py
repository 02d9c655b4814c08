"""AutoEP: automatic expert parallelism for Hugging Face MoE models (DeepSpeed 0.19's `expert_parallel` block).

`AutoEP(model, parse_autoep_config(block))` finds the model's MoE blocks and replaces each by an
`AutoEPMoELayer` holding this rank's experts; tokens reach their experts by all-to-all. See
docs/compatibility.md ("AutoEP") for what is offered and what is refused.
"""

from __future__ import annotations

from shardspeed.moe.autoep.config import (
    AutoEPConfig,
    MoELayerSpec,
    parse_autoep_config,
    validate_autoep_config,
)
from shardspeed.moe.autoep.detect import AutoEP
from shardspeed.moe.autoep.layer import AutoEPMoELayer

__all__ = [
    "AutoEP",
    "AutoEPConfig",
    "AutoEPMoELayer",
    "MoELayerSpec",
    "parse_autoep_config",
    "validate_autoep_config",
]
