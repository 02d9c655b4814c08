"""The ``zero_optimization`` block and its ``offload_param`` / ``offload_optimizer`` sub-blocks.

Keys and code defaults follow reference §2.5. The ``stage3_*`` names are canonical here (they are the
names DeepSpeed documents); the short names DeepSpeed also accepts (``prefetch_bucket_size``, ...) are
synonyms, mapped silently; truly deprecated names warn. Sizes are counts of elements, not bytes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from .blocks import NonNegInt, PositiveInt
from .build import Key, join
from .errors import ConfigError

__all__ = ["LeafModuleConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "ZenFlowConfig", "ZeroConfig"]

OffloadDevice = Literal["none", "cpu", "nvme"]


class _OffloadBlock:
    """What both offload blocks share: a `device` that switches them on, and `nvme_path` for "nvme"."""

    device: OffloadDevice
    nvme_path: str | None

    @property
    def enabled(self) -> bool:
        """Offload is on unless the device is "none" (a block naming no device changes nothing)."""
        return self.device != "none"

    def validate(self, path: str) -> None:
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(
                f"{join(path, 'nvme_path')}: required when {join(path, 'device')} is 'nvme' "
                f"(a directory on a fast local NVMe disk)"
            )


@dataclass(kw_only=True)
class OffloadParamConfig(_OffloadBlock):
    """``zero_optimization.offload_param``: keep ZeRO-3 parameters in CPU memory or on NVMe."""

    device: OffloadDevice = "none"
    """Where parameters live between uses: none, cpu or nvme. Default none (DeepSpeed's code default)."""
    nvme_path: str | None = None
    """Directory for NVMe offload; required with device nvme. Default null."""
    buffer_count: NonNegInt = 5
    """Number of buffers in the NVMe parameter swap pool. Default 5."""
    buffer_size: PositiveInt = 100_000_000
    """Size of each NVMe parameter swap buffer, in elements. Default 1e8."""
    max_in_cpu: NonNegInt = 1_000_000_000
    """Elements kept in CPU memory when offloading to NVMe. Default 1e9."""
    pin_memory: bool = True
    """Use page-locked CPU memory for the host copies (CUDA only; no effect on CPU). Default true
    (DeepSpeed 0.19; 0.16 defaulted to false)."""


@dataclass(kw_only=True)
class OffloadOptimizerConfig(_OffloadBlock):
    """``zero_optimization.offload_optimizer``: keep optimizer state (and its step) on CPU or NVMe."""

    device: OffloadDevice = "none"
    """Where optimizer state lives: none, cpu or nvme. Default none (DeepSpeed's code default)."""
    nvme_path: str | None = None
    """Directory for NVMe offload; required with device nvme. Default null."""
    buffer_count: NonNegInt = 4
    """Number of buffers for NVMe optimizer-state swapping. Default 4."""
    pin_memory: bool = True
    """Use page-locked CPU memory (CUDA only; no effect on CPU). Default true (DeepSpeed 0.19)."""
    pipeline_read: bool = False
    """Overlap NVMe reads of the next sub-group with the current step. Default false."""
    pipeline_write: bool = False
    """Overlap NVMe writes with the step. Default false."""
    fast_init: bool = False
    """Faster optimizer initialisation when offloading to NVMe. Default false."""
    ratio: Annotated[float, Key(ge=0, le=1)] = 1.0
    """Fraction of the optimizer step run on CPU (ZeRO-3 only below 1). Default 1.0."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload for Superchips (ZeRO-3). Default false."""
    cpuadam_cores_perc: Annotated[float, Key(ge=0, le=1)] = 0.8
    """Share of CPU cores for the CPU optimizer under super_offload. Default 0.8."""

    @property
    def pipeline(self) -> bool:
        """Whether NVMe reads or writes overlap the step (DeepSpeed's derived field)."""
        return self.pipeline_read or self.pipeline_write


# Hugging Face MoE blocks DeepSpeed 0.19 treats as ZeRO-3 leaf modules by default: tokens reach only some
# experts, so hooks per expert would run different collectives on different ranks.
# (lists, as DeepSpeed's; the config's defaults are copies of them)
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def _as_list(value: Any) -> Any:
    """DeepSpeed accepts one string where a list of strings is expected."""
    return [value] if isinstance(value, str) else value


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


@dataclass(kw_only=True)
class LeafModuleConfig:
    """``zero_optimization.leaf_module``: modules ZeRO-3 gathers and releases as one piece (z3 leaf modules).

    A module matched here gets all the parameters of its subtree gathered before its forward, as one unit,
    and no hooks inside it, as ``deepspeed.utils.set_z3_leaf_modules`` does.
    """

    classes: Annotated[list[str], Key(normalize=_as_list)] = field(
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES)
    )
    """Module classes, by class name or ``package.module.Class``. Default: Mixtral's, Qwen2-MoE's and
    Qwen3-MoE's sparse MoE blocks."""
    names: Annotated[list[str], Key(normalize=_as_list)] = field(
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES)
    )
    """Module names (as ``model.named_modules()`` gives them). Default []."""
    name_suffixes: Annotated[list[str], Key(normalize=_as_list)] = field(
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
    )
    """Module-name suffixes (e.g. "mlp.experts"). Default []."""

    def __post_init__(self) -> None:
        self.classes, self.names = _dedupe(self.classes), _dedupe(self.names)
        self.name_suffixes = _dedupe(self.name_suffixes)


@dataclass(kw_only=True)
class ZenFlowConfig:
    """``zero_optimization.zenflow``: DeepSpeed's ZenFlow stall-free offload (present = used)."""

    ACTIVE_WHEN_PRESENT: ClassVar[bool] = True

    topk_ratio: Annotated[float, Key(gt=0, le=1)] = 0.1
    """Share of each 2-D parameter's columns (top by gradient L1 norm) updated on the device at every step;
    1 is accepted (every column: plain AdamW on the device; DeepSpeed requires < 1). Default 0.1."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """When columns are re-selected: every select_interval "step"s or "epoch"s; "auto" = every epoch. Default
    "auto"."""
    select_interval: int | Literal["auto"] = "auto"
    """Steps (or epochs) between re-selections; 0 = select once; "auto" only with select_strategy "auto".
    Default "auto"."""
    update_interval: int | Literal["auto"] = "auto"
    """Steps between the host optimizer's updates of the other columns; "auto" = when their accumulated
    gradient has caught up (auto_ratio). Default "auto"."""
    overlap_step: bool = False
    """Overlap the CPU step with forward/backward. Default false."""
    offload: bool = False
    """Keep the selective optimizer's moments in host memory between steps. Default false."""
    auto_ratio: Annotated[float, Key(ge=0, le=1)] = 0.99
    """update_interval "auto": share of 2-D parameters that must have caught up. Default 0.99."""
    full_warm_up_rounds: NonNegInt = 0
    """Ordinary ZeRO-Offload steps (every column on the host) before ZenFlow starts. Default 0."""
    pt_reserved_cores_perc: Annotated[float, Key(ge=0, le=1)] = 0.5
    """Share of cores kept for PyTorch. Default 0.5."""
    steps_per_epoch: PositiveInt | None = None
    """Optimizer steps per epoch for the "epoch" strategy; null = the training dataloader's. Default null."""

    def validate(self, path: str) -> None:
        for key in ("select_interval", "update_interval"):
            value, least = getattr(self, key), 1 if key == "update_interval" else 0
            if value != "auto" and value < least:
                raise ConfigError(f'{join(path, key)}: must be "auto" or an integer >= {least}, got {value}')


_PREFETCH_SYNONYMS = ("prefetch_bucket_size",)
_GATHER_SYNONYMS = ("gather_16bit_weights_on_model_save",)
_GATHER_DEPRECATED = ("stage3_gather_fp16_weights_on_model_save",)


@dataclass(kw_only=True)
class ZeroConfig:
    """``zero_optimization``: ZeRO partitioning of optimizer states (1), gradients (2) and parameters (3)."""

    stage: Literal[0, 1, 2, 3] = 0
    """0 off, 1 partition optimizer states, 2 + gradients, 3 + parameters. Default 0."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced. Default true."""
    reduce_scatter: bool = True
    """Reduce each gradient slice to its owner (reduce-scatter); false = all-reduce and keep the slice."""
    reduce_bucket_size: PositiveInt = 500_000_000
    """Elements reduced per gradient bucket. Default 5e8."""
    use_multi_rank_bucket_allreduce: bool = True
    """Stage 1/2: one all-reduce per bucket instead of per-owner reduces. Default true."""
    allgather_partitions: bool = True
    """Accepted for compatibility (DeepSpeed parses it but no longer uses it). Default true."""
    allgather_bucket_size: PositiveInt = 500_000_000
    """Stage 1/2: elements per all-gather of updated parameters. Default 5e8."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; null = true (DeepSpeed: true for stage 3 only)."""
    compute_grad_norm: bool = True
    """Stage 1/2: compute the global gradient norm at each step; false skips it (needs gradient_clipping
    0; ``get_global_grad_norm()`` then returns None). Default true."""
    load_from_fp32_weights: bool = True
    """On load, restore fp32 master weights from the checkpoint's fp32 copy. Default true."""
    elastic_checkpoint: bool = False
    """Stage 1/2 elastic checkpoint layout (unsupported in DeepSpeed too). Default false."""
    offload_param: OffloadParamConfig | None = None
    """Stage 3 parameter offload; null = off."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1-3); null = off."""
    sub_group_size: PositiveInt = 1_000_000_000
    """Stage 3: elements per optimizer-step tile. Default 1e9 (DeepSpeed's code; its docs say 1e12)."""
    stage3_prefetch_bucket_size: Annotated[NonNegInt, Key(synonyms=_PREFETCH_SYNONYMS)] = 50_000_000
    """Stage 3: elements fetched ahead of use. Default 5e7 (DeepSpeed's code; its docs say 5e8)."""
    stage3_param_persistence_threshold: Annotated[
        NonNegInt, Key(synonyms=("param_persistence_threshold",))
    ] = 100_000
    """Stage 3: parameters with at most this many elements stay gathered. Default 1e5."""
    stage3_model_persistence_threshold: Annotated[
        NonNegInt, Key(synonyms=("model_persistence_threshold",))
    ] = sys.maxsize
    """Stage 3: cap on the total elements of persistent parameters. Default sys.maxsize."""
    stage3_max_live_parameters: Annotated[NonNegInt, Key(synonyms=("max_live_parameters",))] = 1_000_000_000
    """Stage 3: most gathered elements resident at once. Default 1e9."""
    stage3_max_reuse_distance: Annotated[NonNegInt, Key(synonyms=("max_reuse_distance",))] = 1_000_000_000
    """Stage 3: keep a parameter gathered if it is reused within this many elements. Default 1e9."""
    stage3_gather_16bit_weights_on_model_save: Annotated[
        bool, Key(synonyms=_GATHER_SYNONYMS, aliases=_GATHER_DEPRECATED)
    ] = False
    """Stage 3: gather full 16-bit weights so save_16bit_model writes a whole model. Default false."""
    stage3_module_granularity_threshold: Annotated[
        NonNegInt, Key(synonyms=("module_granularity_threshold",))
    ] = 0
    """Stage 3: small modules below this size become leaf modules fetched as one. Default 0 (off)."""
    stage3_use_all_reduce_for_fetch_params: Annotated[
        bool, Key(synonyms=("use_all_reduce_for_fetch_params",))
    ] = False
    """Stage 3: fetch parameters with all-reduce instead of all-gather. Default false."""
    stage3_allgather_sequential: Annotated[bool, Key(synonyms=("allgather_sequential",))] = False
    """Stage 3: gather a unit's parameters one collective per parameter instead of one per unit. Default
    false."""
    leaf_module: LeafModuleConfig = field(default_factory=LeafModuleConfig)
    """Stage 3: modules gathered as one piece (z3 leaf modules)."""
    zenflow: ZenFlowConfig | None = None
    """ZenFlow; null = off."""
    parameter_alignment: bool = False
    """Stage 1/2: pad flat buffers so each parameter starts 16-byte aligned. Default false."""
    enable_sanity_checks: bool = False
    """DeepSpeed's internal debugging checks. Default false."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Muon optimizer under NVMe offload: keep its momentum in memory. Default false."""
    ignore_unused_parameters: bool = True
    """Stage 1/2 offload: tolerate parameters that get no gradient. Default true."""
    legacy_stage1: bool = False
    """Removed in DeepSpeed 0.5.9; true is an error. Default false."""
    round_robin_gradients: bool = False
    """Stage 1/2: order gradients so consecutive ones belong to different ranks. Default false."""
    zero_hpz_partition_size: Annotated[int, Key(ge=1)] = 1
    """ZeRO++ hpZ secondary partition size (e.g. GPUs per node). Default 1 (off)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: quantized all-gather of weights. Default false."""
    zero_quantized_nontrainable_weights: bool = False
    """Store frozen weights quantized. Default false."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: quantized gradient reduction. Default false."""
    memory_efficient_linear: bool = True
    """zero.Init replaces F.linear with a memory-efficient version. Default true."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: the ranks of a machine copy their checkpoint partitions one after another. Default false."""
    override_module_apply: bool = True
    """zero.Init gathers parameters inside nn.Module.apply. Default true."""
    log_trace_cache_warnings: bool = False
    """Stage 3: log invalidations of the parameter-fetch trace. Default false."""

    def __post_init__(self) -> None:
        # DeepSpeed defaults to overlapping only in stage 3, because its overlap doubles the gradient buffers.
        # Ours costs nothing in stages 0-1 (reduction is in place) and at most two staging buckets in stages
        # 2-3, so it is on unless turned off.
        if self.overlap_comm is None:
            self.overlap_comm = True

    def validate(self, path: str) -> None:
        if self.legacy_stage1:
            raise ConfigError(
                f"{join(path, 'legacy_stage1')}: true is no longer supported (removed in DeepSpeed 0.5.9); "
                f"remove the key and use stage 1"
            )
        self._check_offload(path)
        if self.pipeline_loading_checkpoint and self.stage != 3:
            raise ConfigError(
                f"{join(path, 'pipeline_loading_checkpoint')}: true is supported only with {join(path, 'stage')} 3 "
                f"(as in DeepSpeed), got stage {self.stage}"
            )
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ConfigError(
                f"{join(path, 'compute_grad_norm')}: false is supported only with {join(path, 'stage')} 1 or 2, "
                f"got stage {self.stage}"
            )

    def _check_offload(self, path: str) -> None:
        param, optim = self.offload_param, self.offload_optimizer
        if param is not None and param.device != "none" and self.stage != 3:
            raise ConfigError(
                f"{join(path, 'offload_param')}: parameter offload needs {join(path, 'stage')} 3, "
                f"got stage {self.stage} (use offload_optimizer for stages 1 and 2)"
            )
        if optim is not None and optim.device != "none" and self.stage == 0:
            raise ConfigError(
                f"{join(path, 'offload_optimizer.device')}: optimizer offload needs {join(path, 'stage')} 1, 2 "
                f"or 3, got stage 0 (nothing is partitioned to offload)"
            )
        if optim is not None and optim.ratio < 1.0 and self.stage != 3:
            raise ConfigError(
                f"{join(path, 'offload_optimizer.ratio')}: a ratio below 1 ({optim.ratio}) needs "
                f"{join(path, 'stage')} 3, got stage {self.stage}"
            )
