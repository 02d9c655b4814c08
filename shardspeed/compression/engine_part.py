"""``CompressionSchedule``: the engine's part for ``compression_training`` — it steps DeepSpeed's scheduler.

The engine calls ``before_forward(global_steps)`` in forward and ``after_step()`` after each applied
optimizer step (DeepSpeed 0.18.9's ``engine.forward`` step-zero check and ``_take_model_step``). The
scheduler itself is ``engine.compression_scheduler``; ``checkpoint_part()`` is its checkpoint part, the
scheduler's ``state_dict`` under ``compression_scheduler`` (None without enabled techniques), loaded with the
LR scheduler's states. Without enabled techniques both calls cost an attribute check.
"""

from __future__ import annotations

from shardspeed.checkpoint.parts import NamedState
from shardspeed.config import ConfigError

from .compressible import Compressible
from .scheduler import compression_scheduler

__all__ = ["CompressionSchedule"]


class CompressionSchedule:
    def __init__(self, module, config):
        block = config.compression_training
        self.scheduler = compression_scheduler(module, block)
        self.active = bool(block.enabled_techniques())
        if self.active and not any(isinstance(m, Compressible) for m in module.modules()):
            raise ConfigError(
                f"compression_training: {', '.join(block.enabled_techniques())} enabled but the model has no "
                "compression layers; call deepspeed.compression.compress.init_compression(model, config) "
                "before deepspeed.initialize"
            )

    def before_forward(self, global_steps: int) -> None:
        if self.active and global_steps == 0:
            self.scheduler.step(step_zero_check=True)

    def after_step(self) -> None:
        if self.active:
            self.scheduler.step()

    def state_dict(self) -> dict | None:
        return self.scheduler.state_dict() if self.active else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.active and state is not None:
            self.scheduler.load_state_dict(state)

    def checkpoint_part(self) -> NamedState:
        return NamedState("compression_scheduler", self, scheduler=True)
