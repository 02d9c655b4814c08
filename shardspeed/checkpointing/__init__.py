"""`shardspeed.checkpointing`: activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`).

    deepspeed.checkpointing.configure(mpu, deepspeed_config=cfg)    # or from initialize()'s config
    x = deepspeed.checkpointing.checkpoint(block, x)

Not to be confused with `shardspeed.checkpoint`, which saves and loads model checkpoints.
"""

from __future__ import annotations

import sys

from shardspeed.checkpointing import state
from shardspeed.checkpointing.core import CheckpointFunction, checkpoint, non_reentrant_checkpoint, reset
from shardspeed.checkpointing.module_globals import CheckpointingModule
from shardspeed.checkpointing.rng import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from shardspeed.core.usage_errors import ArgumentUsageError

__all__ = [
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:  # fmt: skip
    """Set the options: the `activation_checkpointing` block of `deepspeed_config` (a dict, a path, or a
    loaded config), overridden by any argument given explicitly, as in DeepSpeed."""
    block = _block(deepspeed_config)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    values = {name: getattr(block, name) for name in overrides}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values["contiguous_memory_optimization"] and values["number_checkpoints"] is None:
        raise ArgumentUsageError(  # DeepSpeed asserts here
            "activation_checkpointing.contiguous_memory_optimization needs number_checkpoints (or "
            "configure(num_checkpoints=...)): the number of layers, one preallocated buffer each"
        )
    reset()
    state.configure(state.Settings(mpu=mpu_, **values))


def _block(deepspeed_config):
    """The `activation_checkpointing` block of a loaded config, a dict, or a JSON/HJSON path."""
    from shardspeed.config.build import BuildContext, build_block
    from shardspeed.config.features import ActivationCheckpointingConfig
    from shardspeed.config.loader import read_config_source

    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if hasattr(deepspeed_config, "activation_checkpointing"):  # a loaded ShardspeedConfig
        return deepspeed_config.activation_checkpointing
    raw = read_config_source(deepspeed_config).get("activation_checkpointing", {})
    return build_block(ActivationCheckpointingConfig, raw, "activation_checkpointing", BuildContext())


def is_configured() -> bool:
    """True once `configure` ran (DeepSpeed's models check this before calling `checkpoint`)."""
    return state.is_configured()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    settings = state.current()
    settings.partition_activations = bool(partition_activation)
    state.configure(settings)


def set_num_layers(nlayers: int) -> None:
    settings = state.current()
    settings.number_checkpoints = int(nlayers)
    state.configure(settings)


# DeepSpeed's module globals (PARTITION_ACTIVATIONS, CPU_CHECKPOINT, num_layers, ...) as views of the settings
sys.modules[__name__].__class__ = CheckpointingModule
