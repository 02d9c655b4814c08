"""DeepSpeed's module-level option names of `deepspeed.checkpointing`, read and written as the settings.

DeepSpeed keeps the activation-checkpointing options in module globals (`PARTITION_ACTIVATIONS`,
`CPU_CHECKPOINT`, `num_layers`, ...) that `configure` sets and that code reads, or saves and restores. Here
the options live in one `Settings` object (state.py); these properties of the module make each global
name a view of its field, so reading one gives the option in effect and assigning one changes it.
`deepspeed_checkpointing_enabled` is whether `configure` ran (assigning False forgets the configuration).
"""

from __future__ import annotations

import types

from shardspeed.checkpointing import state

__all__ = ["CheckpointingModule"]

# DeepSpeed's global name -> the Settings field it is
_FIELDS = {
    "PARTITION_ACTIVATIONS": "partition_activations",
    "CONTIGUOUS_CHECKPOINTING": "contiguous_memory_optimization",
    "CPU_CHECKPOINT": "cpu_checkpointing",
    "num_layers": "number_checkpoints",
    "SYNCHRONIZE": "synchronize_checkpoint_boundary",
    "PROFILE_TIME": "profile",
    "mpu": "mpu",
}


def _option(field: str) -> property:
    def get(module):
        return getattr(state.current(), field)

    def set_(module, value) -> None:
        settings = state.current()
        setattr(settings, field, value)
        state.configure(settings)

    return property(get, set_, doc=f"The `{field}` option in effect (DeepSpeed's module global).")


def _get_enabled(module) -> bool:
    return state.is_configured()


def _set_enabled(module, value: bool) -> None:
    state.configure(state.current() if value else None)


class CheckpointingModule(types.ModuleType):
    """The class of `shardspeed.checkpointing`: a module whose DeepSpeed globals are its settings."""

    deepspeed_checkpointing_enabled = property(_get_enabled, _set_enabled)


for _name, _field in _FIELDS.items():
    setattr(CheckpointingModule, _name, _option(_field))
