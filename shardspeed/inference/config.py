"""DeepSpeed's module path for the inference config (``deepspeed.inference.config``); it lives in shardspeed.config."""

from __future__ import annotations

from shardspeed.config.inference import (
    InferenceCheckpointConfig,
    InferenceConfig,
    InferenceTensorParallelConfig,
    load_inference_config,
)

__all__ = [
    "DeepSpeedInferenceConfig",
    "DeepSpeedTPConfig",
    "InferenceCheckpointConfig",
    "InferenceConfig",
    "load_inference_config",
]

DeepSpeedInferenceConfig = InferenceConfig
DeepSpeedTPConfig = InferenceTensorParallelConfig
