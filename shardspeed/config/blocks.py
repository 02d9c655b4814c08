"""Config blocks of the training core: precision, optimizer, scheduler, data types, checkpoint.

Defaults are DeepSpeed's *code* defaults (reference §2.2, §2.3, §2.9), not its documentation's.
Shared field types (``PositiveInt``, ``DtypeName``, ...) live here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from .build import Key, join, show
from .errors import ConfigError

__all__ = [
    "Bf16Config",
    "CheckpointConfig",
    "CheckpointWriterConfig",
    "DataTypesConfig",
    "DtypeName",
    "Fp16Config",
    "NonNegFloat",
    "NonNegInt",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "PositiveFloat",
    "PositiveInt",
    "SchedulerConfig",
    "TorchAutocastConfig",
]

PositiveInt = Annotated[int, Key(gt=0)]
NonNegInt = Annotated[int, Key(ge=0)]
PositiveFloat = Annotated[float, Key(gt=0)]
NonNegFloat = Annotated[float, Key(ge=0)]

_DTYPE_SYNONYMS = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def _dtype_name(value: Any) -> Any:
    """Map DeepSpeed's dtype spellings ("float16", "torch.bfloat16", "BF16") onto fp32/fp16/bf16."""
    return _DTYPE_SYNONYMS.get(value.lower(), value) if isinstance(value, str) else value


DtypeName = Annotated[Literal["fp32", "fp16", "bf16"], Key(normalize=_dtype_name)]


@dataclass(kw_only=True)
class Fp16Config:
    """``fp16``: half-precision training with loss scaling."""

    enabled: bool = False
    """Train in fp16: module parameters cast to fp16, fp32 master weights in the optimizer. Default false."""
    auto_cast: bool = False
    """Cast floating-point inputs of the module's forward to fp16. Default false."""
    loss_scale: NonNegFloat = 0.0
    """0 = dynamic loss scaling; > 0 = this static scale. Default 0."""
    initial_scale_power: NonNegInt = 16
    """Dynamic scaling starts at 2**initial_scale_power. Default 16."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale is doubled; > 0 under dynamic scaling. Default 1000."""
    hysteresis: Annotated[int, Key(ge=1)] = 2
    """Overflows tolerated before the scale is halved. Default 2."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step. Default false."""
    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this; > 0 under dynamic scaling. Default 1."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and grads in fp16 (DeepSpeed: ZeRO-2 + CPU offload only). Default false."""

    @property
    def dynamic_scaling(self) -> bool:
        """Whether the loss scale moves: fp16 on and no static ``loss_scale``."""
        return self.enabled and self.loss_scale == 0

    def validate(self, path: str) -> None:
        if not math.isfinite(self.loss_scale):
            raise ConfigError(
                f"{join(path, 'loss_scale')}: must be a finite number, got {show(self.loss_scale)}"
            )
        # The window and the floor only steer the dynamic scale, so (as in DeepSpeed 0.19) they are checked only
        # when it is on: a static-scale config carrying unused values stays valid. Under dynamic scaling a
        # window of 0 would divide by zero at the first clean step and a floor of 0 lets the scale collapse.
        if not self.dynamic_scaling:
            return
        for name in ("loss_scale_window", "min_loss_scale"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(
                    f"{join(path, name)}: must be > 0 under dynamic loss scaling (enabled with loss_scale 0), "
                    f"got {show(value)}"
                )


@dataclass(kw_only=True)
class Bf16Config:
    """``bf16`` (legacy name ``bfloat16``): bfloat16 training, no loss scaling."""

    enabled: bool = False
    """Train in bf16 with fp32 master weights. Default false."""
    immediate_grad_update: bool = False
    """Apply each gradient to the fp32 accumulator as soon as it is produced. Default false."""
    check_grad_overflow: bool = True
    """Skip an optimizer step whose gradients hold inf or nan (counted in skipped_steps). Default true."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in bf16 instead of fp32 (ZeRO 1-3). Default false."""
    bf16_optimizer_states: bool = False
    """Keep optimizer state in bf16 (needs bf16_master_weights_and_grads). Default false."""


@dataclass(kw_only=True)
class TorchAutocastConfig:
    """``torch_autocast``: run the forward under ``torch.autocast``; parameters stay fp32."""

    enabled: bool = False
    """Wrap the module's forward in torch.autocast. Default false."""
    dtype: DtypeName | None = None
    """Autocast dtype (fp16 or bf16); null = torch's default for the device (bf16 on CPU, fp16 on CUDA)."""
    lower_precision_safe_modules: list[str] | None = None
    """Module classes (``package.Class``) whose parameters' gradients are reduced in the autocast dtype;
    null = torch.nn Linear, Conv1d, Conv2d and Conv3d. Gradients of all other parameters are reduced in
    fp32. Default null."""

    def validate(self, path: str) -> None:
        if self.dtype == "fp32":
            raise ConfigError(f'{join(path, "dtype")}: must be a lower precision (fp16 or bf16), got "fp32"')


@dataclass(kw_only=True)
class OptimizerConfig:
    """``optimizer``: the optimizer the engine builds when the script passes none."""

    REQUIRED_EXAMPLE: ClassVar[str] = ' (the optimizer name, e.g. "type": "AdamW")'

    type: str
    """Optimizer name: DeepSpeed's (Adam, AdamW, Lamb, ...; case-insensitive) or any torch.optim class. Required."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, betas, ...), checked by the optimizer builder. Default {}."""
    legacy_fusion: bool = False
    """Accepted for compatibility; has no effect. Default false."""

    def validate(self, path: str) -> None:
        if not self.type.strip():
            raise ConfigError(f"{join(path, 'type')}: must name an optimizer, got {show(self.type)}")
        if "max_grad_norm" in self.params:
            raise ConfigError(
                f"{join(path, 'params.max_grad_norm')}: gradient clipping is not an optimizer argument; "
                f"remove it and set the top-level 'gradient_clipping' key instead "
                f"(got {show(self.params['max_grad_norm'])})"
            )


@dataclass(kw_only=True)
class SchedulerConfig:
    """``scheduler``: the learning-rate schedule the engine builds when the script passes none."""

    REQUIRED_EXAMPLE: ClassVar[str] = ' (the schedule name, e.g. "type": "WarmupLR")'

    type: str
    """Schedule name: DeepSpeed's (WarmupLR, WarmupDecayLR, ...) or any torch.optim.lr_scheduler class. Required."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the schedule, checked by the schedule builder. Default {}."""

    def validate(self, path: str) -> None:
        if not self.type.strip():
            raise ConfigError(f"{join(path, 'type')}: must name a schedule, got {show(self.type)}")


@dataclass(kw_only=True)
class DataTypesConfig:
    """``data_types``: dtypes of gradient accumulation, parameters and buffers (DeepSpeed 0.19's block)."""

    grad_accum_dtype: DtypeName | None = None
    """Dtype gradients accumulate in; null = the model's dtype (bf16 without ZeRO: fp32). Default null."""
    param_dtype: DtypeName | None = None
    """Dtype of the module's parameters; must match the precision block (fp16, bf16, else fp32). Default
    null (follow the precision block)."""
    buffer_dtype: DtypeName | None = None
    """Cast the module's floating buffers to this dtype; null = buffers keep the dtype they were loaded in
    (e.g. an fp32 rotary table stays fp32 under bf16). Default null."""
    keep_in_fp32_modules: Literal["auto"] | list[str] = "auto"
    """Buffers kept in fp32 under fp16/bf16 training: "auto" = the model's own Transformers lists
    (``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules`` under fp16); a list = name patterns
    (``*`` matches anything, a pattern may match anywhere in the buffer's full name); [] = none.
    Default "auto"."""


@dataclass(kw_only=True)
class ParallelWriteConfig:
    """``checkpoint.parallel_write``."""

    pipeline_stage: bool = False
    """Spread pipeline layer files over data-parallel ranks when saving. Default false."""


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


@dataclass(kw_only=True)
class CheckpointWriterConfig:
    """``checkpoint.writer``: DeepSpeed's fast checkpoint writer (present = used, as in DeepSpeed)."""

    ACTIVE_WHEN_PRESENT: ClassVar[bool] = True

    type: Annotated[Literal["MOCK", "PYTHON", "FAST"], Key(normalize=_upper)] = "FAST"
    """Writer: MOCK, PYTHON or FAST (case-insensitive). Default FAST."""
    io_buffer_size: PositiveInt = 64 * 2**20
    """Bytes of the writer's I/O buffer. Default 64 MiB."""
    io_buffer_double: bool = True
    """Double-buffer the I/O. Default true."""
    io_multiplier: PositiveInt = 1
    """I/O parallelism multiplier. Default 1."""
    show_statistics: bool = False
    """Print write statistics. Default false."""
    data_parallel: Annotated[Literal["REPLICA", "SOCKET", "MACHINE"] | None, Key(normalize=_upper)] = None
    """Spread writes over data-parallel ranks per REPLICA, SOCKET or MACHINE. Default null."""
    decoupled: bool = False
    """Write in the background while training continues. Default false."""


def _tag_mode(value: Any) -> Any:
    return value.capitalize() if isinstance(value, str) else value


@dataclass(kw_only=True)
class CheckpointConfig:
    """``checkpoint``: checkpoint behaviour."""

    tag_validation: Annotated[Literal["Ignore", "Warn", "Fail"], Key(normalize=_tag_mode)] = "Warn"
    """Check that all ranks save under the same tag: Ignore, Warn or Fail (case-insensitive). Default Warn."""
    load_universal: bool = False
    """Load DeepSpeed's universal layout (`latest_universal`, `<tag>/zero/<param>/`, written by ds_to_universal) at
    any world size and ZeRO stage. Default false."""
    use_node_local_storage: bool = False
    """Each node's local rank 0 writes model files (node-local disks). Default false."""
    parallel_write: ParallelWriteConfig = field(default_factory=ParallelWriteConfig)
    """Parallel checkpoint writing options."""
    checkpoint_serialization: bool = True
    """Write with torch's zip serialization; false = DeepSpeed's fast writer's raw layout. Default true."""
    writer: CheckpointWriterConfig | None = None
    """DeepSpeed's fast checkpoint writer; null = torch.save. Default null."""
