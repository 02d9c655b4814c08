"""The one typed, validated config system: DeepSpeed's JSON schema as dataclasses.

    cfg = load_config("ds_config.json", world_size=2)
    cfg.train_batch_size, cfg.zero_optimization.stage, cfg.fp16.enabled, cfg.raw, cfg.to_dict()

Modules: ``build`` (generic type checking), ``blocks``/``zero``/``monitoring``/``features`` (the block
dataclasses), ``schema`` (the top level), ``batch`` (the batch triple), ``deprecated`` (old forms),
``validate`` (cross-block checks), ``implemented`` (what is built; everything else is refused),
``loader`` (sources and order).
"""

from .batch import resolve_batch_sizes
from .blocks import (
    Bf16Config,
    CheckpointConfig,
    DataTypesConfig,
    Fp16Config,
    OptimizerConfig,
    SchedulerConfig,
)
from .build import ConfigWarning
from .errors import ConfigError
from .implemented import IMPLEMENTED
from .loader import load_config
from .schema import ShardspeedConfig
from .zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "IMPLEMENTED",
    "Bf16Config",
    "CheckpointConfig",
    "ConfigError",
    "ConfigWarning",
    "DataTypesConfig",
    "Fp16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ShardspeedConfig",
    "ZeroConfig",
    "load_config",
    "resolve_batch_sizes",
]
