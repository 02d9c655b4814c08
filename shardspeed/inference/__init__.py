"""Inference: ``init_inference`` and the ``InferenceEngine`` (DeepSpeed's ``deepspeed.inference``).

    engine = shardspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float16)
    logits = engine(input_ids).logits
    tokens = engine.generate(input_ids, max_new_tokens=64)

Modules: ``engine`` (the engine and its construction), ``decoder`` (decode paths), ``kv_cache`` (static and
paged caches), ``generation`` (the loop and sampling), ``loading`` (weights, one tensor at a time),
``quantize`` (int8 weights). The config is ``shardspeed.config.inference``.
"""

from __future__ import annotations

import dataclasses

from shardspeed.config.inference import InferenceConfig, load_inference_config

from .engine import InferenceEngine

__all__ = [
    "InferenceConfig",
    "InferenceEngine",
    "default_inference_config",
    "init_inference",
]


def init_inference(model, config=None, **kwargs) -> InferenceEngine:
    """DeepSpeed's ``init_inference``: ``config`` (None, dict or JSON path) merged with keyword arguments."""
    return InferenceEngine(model, load_inference_config(config, kwargs))


def default_inference_config() -> dict:
    """DeepSpeed's ``default_inference_config()``: every inference key with its default value."""
    config = dataclasses.asdict(InferenceConfig())
    for name in ("tp_group", "mpu"):  # Python objects, not config values
        config["tensor_parallel"].pop(name, None)
    return config
