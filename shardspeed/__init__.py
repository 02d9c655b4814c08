"""shardspeed: DeepSpeed's training API and JSON config, in pure Python on PyTorch.

    import shardspeed as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")

Names are imported lazily (PEP 562): `import shardspeed` stays cheap for the launcher, which starts
processes and must not pay for importing torch first.
"""

from __future__ import annotations

import importlib
import warnings

from shardspeed.version import __version__ as __version__

# torch warns at import when NumPy is absent; NumPy is optional for torch and unused by shardspeed, so a
# clean install would print a warning on every start. Targeted at that one message (it fires only when
# shardspeed is imported before torch, as the examples do).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# public name -> (module, attribute); an attribute of None means the module itself
_LAZY = {
    "CheckpointError": ("shardspeed.checkpoint.files", "CheckpointError"),
    "ConfigError": ("shardspeed.config.errors", "ConfigError"),
    "DeepSpeedConfigError": ("shardspeed.config.errors", "ConfigError"),
    "DeepSpeedEngine": ("shardspeed.runtime.engine", "ShardspeedEngine"),
    "RepeatingLoader": ("shardspeed.runtime.data", "RepeatingLoader"),
    "ShardspeedEngine": ("shardspeed.runtime.engine", "ShardspeedEngine"),
    "add_config_arguments": ("shardspeed.api", "add_config_arguments"),
    "checkpointing": ("shardspeed.checkpointing", None),
    "comm": ("shardspeed.comm", None),
    "init_distributed": ("shardspeed.comm.init", "init_distributed"),
    "initialize": ("shardspeed.api", "initialize"),
    "init_inference": ("shardspeed.inference", "init_inference"),
    "default_inference_config": ("shardspeed.inference", "default_inference_config"),
    "InferenceEngine": ("shardspeed.inference.engine", "InferenceEngine"),
    "tp_model_init": ("shardspeed.placeholders", "tp_model_init"),
    "monitor": ("shardspeed.monitor", None),
    "profiling": ("shardspeed.profiling", None),
    "pipe": ("shardspeed.pipe", None),
    "PipelineEngine": ("shardspeed.pipe.engine", "PipelineEngine"),
    "zero": ("shardspeed.zero", None),
}

__all__ = sorted([*_LAZY, "__version__"])


def __getattr__(name: str):
    if name not in _LAZY:
        # Subpackages as attributes without importing them first (`deepspeed.runtime.lr_schedules`,
        # `deepspeed.checkpointing.configure`): code written for DeepSpeed relies on a bare `import deepspeed`.
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"shardspeed.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"shardspeed.{name}":
                    raise
        raise AttributeError(f"module 'shardspeed' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
