"""What `configure` set: the options of the `activation_checkpointing` block and the model-parallel group.

One module-level `Settings` object, as DeepSpeed has one configuration per process; `configure` replaces
it and `reset` drops its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Settings", "configure", "current", "is_configured", "model_parallel_rank"]


@dataclass
class Settings:
    """Options in effect; field names are the config block's keys."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    mpu: object | None = None
    """DeepSpeed's `mpu` (model-parallel unit): anything with `get_model_parallel_group()` or
    `get_tensor_model_parallel_group()`; None means no model parallelism."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in checkpointed forwards and recomputations (when `profile`)."""


_current: Settings | None = None


def current() -> Settings:
    """The configured settings, or the defaults (everything off) before `configure`."""
    return _current if _current is not None else Settings()


def is_configured() -> bool:
    return _current is not None


def configure(settings: Settings | None) -> None:
    """Install `settings` (None: back to "not configured")."""
    global _current
    _current = settings


def model_parallel_group(settings: Settings | None = None):
    """The group activations are partitioned over, or None without model parallelism."""
    mpu = (settings or current()).mpu
    if mpu is None:
        return None
    for getter in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        if hasattr(mpu, getter):
            return getattr(mpu, getter)()
    raise TypeError(
        f"activation_checkpointing: the mpu {type(mpu).__name__} has neither get_model_parallel_group() nor "
        "get_tensor_model_parallel_group()"
    )


def model_parallel_rank() -> int:
    group = model_parallel_group()
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)
