"""``compression_training``: DeepSpeed 0.18.9's compression block (``deepspeed.compression``), typed.

Seven techniques, each a ``shared_parameters`` object (switch, schedule, method) plus ``different_groups``:
named groups of modules (regular expressions searched in module names) with their own ``params``. Keys,
defaults and checks are 0.18.9's (its ``compression/config.py`` and ``constants.py``); where 0.18.9 crashes
or ignores a value, this block refuses it with the key path instead:

* ``sparse_pruning.method: "snip_momentum"`` needs Intel Neural Compressor in DeepSpeed; it is refused,
  and so are the keys only that method reads (``block_pattern``, ``dense_ratio``, ``excluded_modules``,
  ``schedule_offset_stride``) under ``l1``/``topk``. ``schedule_offset_end`` defaults to
  ``schedule_offset`` for every method (0.18.9 fills it only for snip_momentum and then raises KeyError).
* ``modules`` must be a list (0.18.9 iterates a string letter by letter); ``"*"`` (its documented default)
  means every Linear and Conv2d layer. ``related_modules`` needs one list per ``modules`` entry (0.18.9
  truncates the shorter silently).
* 1- and 2-bit weights (binary, ternary) are symmetric with nearest rounding, as 0.18.9 asserts at run time.

The techniques themselves live in ``shardspeed/compression``; the engine steps them (``engine_part.py``).
This module holds the typed blocks, which ``schema.py`` embeds; ``compression.py`` adds
``build_compression_config`` (which reads a whole config, so it sits above ``schema`` and ``loader``) and
is the module to import them from.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from .blocks import NonNegInt, PositiveInt
from .build import ConfigWarning, Key, join, show
from .compression_groups import ActivationQuantizationGroup, DenseRatio, PruningGroup, WeightQuantizationGroup
from .errors import ConfigError

Method = Literal["l1", "topk"]
QuantizationType = Literal["symmetric", "asymmetric"]
# every technique except layer_reduction, in the order redundancy_clean applies them (0.18.9's order)
TECHNIQUES = (
    "weight_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
    "activation_quantization",
)


# ---- shared parameters, one block per technique --------------------------------------------------------


@dataclass(kw_only=True)
class Fp16MixedQuantizeConfig:
    """``weight_quantization.shared_parameters.fp16_mixed_quantize``: blend full and quantized weights."""

    enabled: bool = False
    """Use ``r * w + (1 - r) * q(w)``, r falling from 1 by quantize_change_ratio per step. Default false."""
    quantize_change_ratio: Annotated[float, Key(ge=0, le=1)] = 0.001
    """How much r falls per step (reset to 1 when a bit is dropped). Default 0.001."""


@dataclass(kw_only=True)
class WeightQuantizationShared:
    """``weight_quantization.shared_parameters``."""

    enabled: bool = False
    """Quantize the weights of the groups' modules. Default false."""
    quantizer_kernel: bool = False
    """DeepSpeed's CUDA quantizer kernel; here the one PyTorch quantizer serves both values. Default false."""
    schedule_offset: NonNegInt = 0
    """Steps before quantization starts. Default 0."""
    quantize_groups: PositiveInt = 1
    """Groups per weight matrix (its flattened elements in equal runs), each with its own scale. Default 1."""
    quantize_verbose: bool = False
    """Log every bit-width change. Default false."""
    quantization_type: QuantizationType = "symmetric"
    """symmetric (scale only) or asymmetric (scale and zero point). Default "symmetric"."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """Rounding during training; redundancy_clean always rounds to nearest. Default "nearest"."""
    quantize_weight_in_forward: bool = False
    """true: quantize in forward (0.18.9's quantization-aware path); false: through DeepSpeed's MoQ fp16
    optimizer, not built here, so false is refused while weight quantization is enabled. Default false."""
    fp16_mixed_quantize: Fp16MixedQuantizeConfig = field(default_factory=Fp16MixedQuantizeConfig)
    """Blend of full-precision and quantized weights while bits change."""


@dataclass(kw_only=True)
class ActivationQuantizationShared:
    """``activation_quantization.shared_parameters``."""

    enabled: bool = False
    """Quantize the inputs of the groups' modules. Default false."""
    quantization_type: QuantizationType = "symmetric"
    """symmetric or asymmetric. Default "symmetric"."""
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    """dynamic: range per token (per sample for Conv2d); static: a running range kept in a buffer. Default "dynamic"."""
    schedule_offset: NonNegInt = 1000
    """Steps before activation quantization starts. Default 1000."""


_SNIP_ONLY = ("block_pattern", "dense_ratio", "excluded_modules", "schedule_offset_stride")


@dataclass(kw_only=True)
class SparsePruningShared:
    """``sparse_pruning.shared_parameters``."""

    enabled: bool = False
    """Mask individual weights. Default false."""
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    """l1: fixed mask of the largest weights; topk: mask from learned scores; snip_momentum: refused. Default "l1"."""
    schedule_offset: NonNegInt = 1000
    """Steps before pruning starts. Default 1000."""
    schedule_offset_end: NonNegInt | None = None
    """Pruning switches on at the first step in [schedule_offset, schedule_offset_end]; null = schedule_offset."""
    schedule_offset_stride: PositiveInt | None = None
    """snip_momentum only. Default null."""
    block_pattern: str | None = None
    """snip_momentum only. Default null."""
    dense_ratio: DenseRatio | None = None
    """snip_momentum only (l1/topk take dense_ratio per group). Default null."""
    excluded_modules: list[str] | None = None
    """snip_momentum only. Default null."""

    def __post_init__(self) -> None:
        if self.schedule_offset_end is None:  # also for the default block, which validate() never sees
            self.schedule_offset_end = self.schedule_offset

    def validate(self, path: str) -> None:
        if self.method == "snip_momentum":
            raise ConfigError(
                f'{join(path, "method")}: "snip_momentum" runs Intel Neural Compressor\'s pruners in DeepSpeed '
                f"(the neural_compressor package), which shardspeed does not use; "
                f'use "l1" (fixed magnitude mask) or "topk" (learned scores)'
            )
        for key in _SNIP_ONLY:
            if getattr(self, key) is not None:
                raise ConfigError(
                    f"{join(path, key)}: only method snip_momentum reads it (got {show(getattr(self, key))}); "
                    f"with l1/topk give dense_ratio in each different_groups entry's params"
                )
        if self.schedule_offset_end < self.schedule_offset:
            raise ConfigError(
                f"{join(path, 'schedule_offset_end')}: {self.schedule_offset_end} is before schedule_offset "
                f"{self.schedule_offset}"
            )


@dataclass(kw_only=True)
class PruningShared:
    """``row_pruning`` / ``channel_pruning`` ``.shared_parameters``."""

    enabled: bool = False
    """Prune whole output rows (Linear) or output channels (Conv2d). Default false."""
    method: Method = "l1"
    """l1: fixed mask from the rows' L1 norms; topk: mask from learned scores. Default "l1"."""
    schedule_offset: NonNegInt = 1000
    """Steps before pruning starts. Default 1000."""


@dataclass(kw_only=True)
class HeadPruningShared:
    """``head_pruning.shared_parameters``."""

    enabled: bool = False
    """Prune attention heads through the attention output matrix's input columns. Default false."""
    method: Method = "topk"
    """topk: learned head scores; l1: the heads' L1 norms (0.18.9 raises NotImplementedError). Default "topk"."""
    schedule_offset: NonNegInt = 1000
    """Steps before pruning starts. Default 1000."""
    num_heads: PositiveInt | None = None
    """Attention heads of the pruned modules. Required when enabled."""

    def validate(self, path: str) -> None:
        if self.enabled and self.num_heads is None:
            raise ConfigError(f"{join(path, 'num_heads')}: required when head pruning is enabled")


# ---- the seven blocks ----------------------------------------------------------------------------------


def _check_groups(block: Any, path: str) -> None:
    if block.shared_parameters.enabled and not block.different_groups:
        raise ConfigError(
            f"{join(path, 'different_groups')}: {path.rsplit('.', 1)[-1]} is enabled but no group is given; "
            f'add e.g. {{"g1": {{"params": {{...}}, "modules": ["regex"]}}}}'
        )


@dataclass(kw_only=True)
class WeightQuantizationConfig:
    """``compression_training.weight_quantization``."""

    shared_parameters: WeightQuantizationShared = field(default_factory=WeightQuantizationShared)
    """Switch, schedule and quantizer settings shared by every group."""
    different_groups: dict[str, WeightQuantizationGroup] = field(default_factory=dict)
    """Named groups: modules and their start/target bits."""

    def validate(self, path: str) -> None:
        _check_groups(self, path)
        shared = self.shared_parameters
        for name, group in self.different_groups.items():
            if group.params.target_bits > 2:
                continue
            where = join(path, f"different_groups.{name}.params.target_bits")
            if shared.quantization_type != "symmetric":
                raise ConfigError(
                    f"{where}: {group.params.target_bits}-bit weights are symmetric ({{-a, a}} or {{-a, 0, a}}); "
                    f'set shared_parameters.quantization_type to "symmetric"'
                )
            if shared.rounding != "nearest":
                raise ConfigError(
                    f"{where}: {group.params.target_bits}-bit weights take no rounding mode; set "
                    f'shared_parameters.rounding to "nearest"'
                )
        if shared.enabled and not shared.quantize_weight_in_forward:
            raise ConfigError(
                f"{join(path, 'shared_parameters.quantize_weight_in_forward')}: false quantizes through DeepSpeed's "
                "MoQ fp16 optimizer, which DeepSpeed 0.19 removed and shardspeed does not build; set it true "
                "(weights quantized in forward: 0.18.9's quantization-aware path)"
            )
        if shared.enabled:
            _warn_moq_only(self, path)


def _warn_moq_only(block: WeightQuantizationConfig, path: str) -> None:
    """start_bits above target_bits asks for MoQ's schedule, which the in-forward path does not run (as in
    0.18.9): say so rather than let the schedule look honoured."""
    for name, group in block.different_groups.items():
        params = group.params
        if params.start_bits != params.target_bits:
            warnings.warn(
                f"{join(path, f'different_groups.{name}.params.start_bits')}: {params.start_bits} (with "
                f"quantization_period {params.quantization_period}) is MoQ's bit schedule, which runs only with "
                f"quantize_weight_in_forward false; quantizing in forward, the weights are quantized at target_bits "
                f"{params.target_bits} from the first enabled step, as in DeepSpeed 0.18.9",
                ConfigWarning,
                stacklevel=2,
            )


@dataclass(kw_only=True)
class ActivationQuantizationConfig:
    """``compression_training.activation_quantization``."""

    shared_parameters: ActivationQuantizationShared = field(default_factory=ActivationQuantizationShared)
    """Switch, schedule and quantizer settings."""
    different_groups: dict[str, ActivationQuantizationGroup] = field(default_factory=dict)
    """Named groups: modules and their bits."""

    def validate(self, path: str) -> None:
        _check_groups(self, path)


@dataclass(kw_only=True)
class SparsePruningConfig:
    """``compression_training.sparse_pruning``."""

    shared_parameters: SparsePruningShared = field(default_factory=SparsePruningShared)
    """Switch, method and schedule."""
    different_groups: dict[str, PruningGroup] = field(default_factory=dict)
    """Named groups: modules and their dense_ratio."""

    def validate(self, path: str) -> None:
        _check_groups(self, path)


@dataclass(kw_only=True)
class RowPruningConfig:
    """``compression_training.row_pruning``."""

    shared_parameters: PruningShared = field(default_factory=PruningShared)
    """Switch, method and schedule."""
    different_groups: dict[str, PruningGroup] = field(default_factory=dict)
    """Named groups: modules, related modules (whose columns go with the rows) and dense_ratio."""

    def validate(self, path: str) -> None:
        _check_groups(self, path)


@dataclass(kw_only=True)
class HeadPruningConfig:
    """``compression_training.head_pruning``."""

    shared_parameters: HeadPruningShared = field(default_factory=HeadPruningShared)
    """Switch, method, schedule and head count."""
    different_groups: dict[str, PruningGroup] = field(default_factory=dict)
    """Named groups: attention output modules, their q/k/v as related modules, and dense_ratio."""

    def validate(self, path: str) -> None:
        _check_groups(self, path)


@dataclass(kw_only=True)
class ChannelPruningConfig:
    """``compression_training.channel_pruning``."""

    shared_parameters: PruningShared = field(default_factory=PruningShared)
    """Switch, method and schedule."""
    different_groups: dict[str, PruningGroup] = field(default_factory=dict)
    """Named groups: Conv2d modules, related Conv2d/BatchNorm2d modules and dense_ratio."""

    def validate(self, path: str) -> None:
        _check_groups(self, path)


@dataclass(kw_only=True)
class LayerReductionConfig:
    """``compression_training.layer_reduction``: a shallower student initialised from teacher layers."""

    enabled: bool = False
    """Initialise the student from the teacher in init_compression. Default false."""
    keep_number_layer: PositiveInt | None = None
    """Layers the student keeps (must equal len(teacher_layer) when given). Default null."""
    module_name_prefix: str | None = None
    """Name of the layer list in both models (e.g. "model.layers", "bert.encoder.layer"). Required when enabled."""
    teacher_layer: list[NonNegInt] | None = None
    """Teacher layer copied into student layer 0, 1, ... Required when enabled."""
    other_module_name: list[str] = field(default_factory=list)
    """Other modules copied whole (embeddings, final norm, head). Default []."""

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        for key in ("module_name_prefix", "teacher_layer"):
            if not getattr(self, key):
                raise ConfigError(f"{join(path, key)}: required when layer reduction is enabled")
        if self.keep_number_layer is not None and self.keep_number_layer != len(self.teacher_layer):
            raise ConfigError(
                f"{join(path, 'keep_number_layer')}: {self.keep_number_layer} but teacher_layer names "
                f"{len(self.teacher_layer)} layers {self.teacher_layer}"
            )


@dataclass(kw_only=True)
class CompressionTrainingConfig:
    """``compression_training``: DeepSpeed 0.18.9's compression library (see docs/compression.md)."""

    weight_quantization: WeightQuantizationConfig = field(default_factory=WeightQuantizationConfig)
    """Weight quantization (ZeroQuant; 1/2 bits: XTC's binary/ternary)."""
    activation_quantization: ActivationQuantizationConfig = field(
        default_factory=ActivationQuantizationConfig
    )
    """Activation (layer input) quantization."""
    sparse_pruning: SparsePruningConfig = field(default_factory=SparsePruningConfig)
    """Unstructured weight pruning."""
    row_pruning: RowPruningConfig = field(default_factory=RowPruningConfig)
    """Output-row pruning of Linear layers."""
    head_pruning: HeadPruningConfig = field(default_factory=HeadPruningConfig)
    """Attention-head pruning."""
    channel_pruning: ChannelPruningConfig = field(default_factory=ChannelPruningConfig)
    """Output-channel pruning of Conv2d layers."""
    layer_reduction: LayerReductionConfig = field(default_factory=LayerReductionConfig)
    """Layer reduction (student from teacher layers)."""

    def technique(self, name: str) -> Any:
        """The block of technique ``name`` (one of TECHNIQUES)."""
        return getattr(self, name)

    def enabled_techniques(self) -> list[str]:
        return [name for name in TECHNIQUES if self.technique(name).shared_parameters.enabled]

    @property
    def any_enabled(self) -> bool:
        return bool(self.enabled_techniques()) or self.layer_reduction.enabled
