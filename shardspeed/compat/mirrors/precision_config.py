"""DeepSpeed's `runtime.precision_config.DeepSpeedFP16Config` / `DeepSpeedBF16Config`: pydantic views of
shardspeed's own `fp16` / `bf16` blocks.

DeepSpeed code (and its tests) builds these classes directly (`DeepSpeedFP16Config(enabled=True,
loss_scale=0, ...)`) and expects pydantic's `ValidationError` for a bad value. So they are pydantic models on
the DeepSpeedConfigModel base, but the rules are shardspeed's, kept in one place: the field names and
defaults are read from `Fp16Config` / `Bf16Config` (shardspeed/config/blocks.py), and after pydantic has
converted the Python values (`"3"` -> 3.0, as any pydantic model does) the block is built by the one config
system, so ranges and the dynamic-loss-scaling rules are exactly those `initialize` applies; its error, which
names the key, becomes the ValidationError. Only what a Python API adds is checked here: a boolean or a
non-number given for a numeric field is refused before pydantic would turn it into 1 or 0.
"""

from __future__ import annotations

import math

from pydantic import ValidationInfo, field_validator, model_validator

from shardspeed.compat.mirrors.config_model import DeepSpeedConfigModel
from shardspeed.config.blocks import Bf16Config, Fp16Config
from shardspeed.config.build import BuildContext, build_block
from shardspeed.config.errors import ConfigError

__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config"]

_FP16 = Fp16Config()
_BF16 = Bf16Config()


def _checked_by_shardspeed(model: DeepSpeedConfigModel, block: type, key: str) -> None:
    """Build shardspeed's block from the model's values; its ConfigError (naming `key.field`) as ValueError,
    which pydantic reports as a ValidationError."""
    try:
        build_block(block, model.model_dump(), key, BuildContext())
    except ConfigError as error:
        raise ValueError(str(error)) from None


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """The `fp16` block: half-precision training with a static or dynamic loss scale."""

    enabled: bool = _FP16.enabled
    auto_cast: bool = _FP16.auto_cast
    loss_scale: float = _FP16.loss_scale
    """0 = dynamic loss scaling; > 0 = this static scale."""
    initial_scale_power: int = _FP16.initial_scale_power
    loss_scale_window: int = _FP16.loss_scale_window
    hysteresis: int = _FP16.hysteresis
    consecutive_hysteresis: bool = _FP16.consecutive_hysteresis
    min_loss_scale: float = _FP16.min_loss_scale
    fp16_master_weights_and_grads: bool = _FP16.fp16_master_weights_and_grads

    @field_validator(
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
        mode="before",
    )
    @classmethod
    def _a_number(cls, value, info: ValidationInfo):
        """A number or a numeric string; pydantic would read True as 1 and refuse a list in its own words."""
        field = f"fp16.{info.field_name}"
        if isinstance(value, bool):
            raise ValueError(f"{field} must be a number, not a boolean")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{field} must be a number, got {value!r}") from None
        if info.field_name != "loss_scale" and not math.isfinite(number):
            raise ValueError(f"{field} must be a finite number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _shardspeed_rules(self):
        _checked_by_shardspeed(self, Fp16Config, "fp16")
        return self

    def initial_dynamic_scale(self) -> float:
        """The dynamic loss scale the first step uses: 2**initial_scale_power."""
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict:
        """The dynamic loss scaler's arguments under DeepSpeed's names (as the engine's method of that name)."""
        return {
            "init_scale": 2**self.initial_scale_power,
            "scale_window": self.loss_scale_window,
            "delayed_shift": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_loss_scale,
        }


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """The `bf16` block (legacy name `bfloat16`): bfloat16 training, no loss scaling."""

    enabled: bool = _BF16.enabled
    immediate_grad_update: bool = _BF16.immediate_grad_update
    check_grad_overflow: bool = _BF16.check_grad_overflow
    bf16_master_weights_and_grads: bool = _BF16.bf16_master_weights_and_grads
    bf16_optimizer_states: bool = _BF16.bf16_optimizer_states

    @model_validator(mode="after")
    def _shardspeed_rules(self):
        _checked_by_shardspeed(self, Bf16Config, "bf16")
        return self
