"""``tensor_parallel``: AutoTP training (DeepSpeed 0.19.8's ``TPTrainingConfig``), typed.

``autotp_size`` > 1 turns tensor parallelism on: ``initialize`` cuts the world into (data, model) with
``autotp_size`` ranks per tensor group and shards the model with AutoTP (module_inject/auto_tp.py).
``partition_config.layer_specs`` are checked here, so a bad regex or partition type is refused with its key
path before any process group exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from .blocks import NonNegInt
from .build import Key, show
from .errors import ConfigError

__all__ = ["PartitionConfig", "PartitionRule", "TensorParallelConfig", "parse_layer_specs"]


# DeepSpeed's inner `tensor_parallel.tp` block besides tp_size (its TPConfig), with its defaults
_INNER_TP_DEFAULTS = {"tp_grain_size": 1, "tp_overlap_comm": False, "mpu": None, "tp_group": None}


@dataclass(kw_only=True)
class PartitionConfig:
    """``tensor_parallel.partition_config``: regex rules that place layers AutoTP's names do not."""

    use_default_specs: bool = True
    """Also apply the built-in layer names after ``layer_specs``. Default true."""
    strict_mode: bool = False
    """DeepSpeed: fail on unmatched linears. shardspeed always fails on unmatched linears inside blocks."""
    layer_specs: list[dict[str, Any]] = field(default_factory=list)
    """Rules ``{"patterns": [regex], "partition_type": "column"|"row"|"skip", "shape", "gather_output",
    "grad_allreduce", "model_types"}``, first match wins (module_inject/autotp_config.py explains each)."""

    def validate(self, path: str) -> None:
        try:
            parse_layer_specs(self.layer_specs, where=f"{path}.layer_specs")
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass(kw_only=True)
class TensorParallelConfig:
    """``tensor_parallel``: AutoTP training."""

    autotp_size: NonNegInt = 0
    """Tensor-parallel degree; 0 or 1 = off. Must divide the world size. Default 0."""
    tp_overlap_comm: bool = False
    """Overlap the row-parallel all-reduce with compute (accepted; collectives here are synchronous). Default false."""
    vocab_parallel_lm_head: bool | None = None
    """Split the token embedding and LM head over the vocabulary (the model's loss must use
    ``vocab_parallel_cross_entropy``). Default null (off)."""
    vocab_parallel_ce_backend: Literal["torch"] = "torch"
    """Cross-entropy over vocabulary-split logits: "torch" (DeepSpeed's default; "liger" is not supported)."""
    partition_config: PartitionConfig | None = None
    """Layer placement rules. Default null (the built-in names only)."""
    dtype: str | None = None
    """Recorded by ``tp_model_init``; the training dtype comes from fp16/bf16. Default null."""
    tp: dict[str, Any] | None = None
    """DeepSpeed's inner ``tp`` block (``tp_size`` must equal ``autotp_size`` when given). Default null."""
    keep_module_on_host: bool = False
    """Inference option, accepted for compatibility. Default false."""
    injection_policy_tuple: Any = None
    """Inference option, accepted for compatibility. Default null."""
    replace_with_kernel_inject: Annotated[bool, Key(synonyms=("kernel_inject",))] = False
    """Inference kernels; must stay false for training. Default false."""
    preset_model: str | None = None
    """DeepSpeed's built-in presets: not supported (AutoTP's names cover those models). Default null."""

    def validate(self, path: str) -> None:
        inner = (self.tp or {}).get("tp_size")
        if inner not in (None, 1, self.autotp_size):
            raise ConfigError(
                f"{path}.tp.tp_size: {inner} does not match {path}.autotp_size {self.autotp_size}"
            )
        for key, value in (self.tp or {}).items():  # the rest of DeepSpeed's inner block: defaults only
            if key == "tp_size":
                continue
            if key not in _INNER_TP_DEFAULTS:
                raise ConfigError(
                    f"unknown key '{path}.tp.{key}'; valid keys: tp_size, {', '.join(_INNER_TP_DEFAULTS)}"
                )
            if value != _INNER_TP_DEFAULTS[key]:
                raise ConfigError(
                    f"{path}.tp.{key}: {show(value)} is not supported by shardspeed's AutoTP training; remove "
                    f"the key or set its default {show(_INNER_TP_DEFAULTS[key])}"
                )
        if self.replace_with_kernel_inject:
            raise ConfigError(
                f"{path}.replace_with_kernel_inject: kernel injection is not available for training"
            )
        if self.preset_model is not None:
            raise ConfigError(
                f"{path}.preset_model: presets are not supported; AutoTP's built-in names cover LLaMA, Mistral, "
                "Qwen2, GPT-2, OPT, GPT-J and BERT, and partition_config.layer_specs places anything else"
            )

    @property
    def size(self) -> int:
        """The tensor-parallel degree (1 when off)."""
        return max(1, self.autotp_size)


@dataclass(frozen=True)
class PartitionRule:
    """One compiled `layer_specs` rule: AutoTP applies the first whose pattern matches a module name."""

    patterns: tuple[re.Pattern, ...]
    kind: str  # "column" | "row" | "skip"
    segments: tuple[int, ...] | int | None = None  # column: sizes of the fused parts, or their count
    gather_output: bool = False  # column: every rank receives the whole output (all-gathered)
    grad_allreduce: bool = False  # skip: the replicated parameters' gradients are summed over the group
    model_types: tuple[str, ...] | None = None  # lower-case `config.model_type`s this rule applies to

    def applies_to(self, model_type: str | None) -> bool:
        return self.model_types is None or (model_type is not None and model_type.lower() in self.model_types)


def parse_layer_specs(specs, where: str = "layer_specs") -> list[PartitionRule]:
    """DeepSpeed's `partition_config.layer_specs` list → compiled specs; errors name the entry."""
    parsed = []
    for i, spec in enumerate(specs or []):
        key = f"{where}[{i}]"
        if not isinstance(spec, dict) or not spec.get("patterns"):
            raise ValueError(
                f"{key}: expected {{'patterns': [regex, ...], 'partition_type': ...}}, got {spec!r}"
            )
        kind = str(spec.get("partition_type", "column")).lower()
        if kind not in ("column", "row", "skip"):
            raise ValueError(f"{key}.partition_type: {kind!r} is not one of 'column', 'row', 'skip'")
        unknown = set(spec) - {"patterns", "partition_type", "shape", "partition_dim", "model_types",
                               "gather_output", "grad_allreduce"}  # fmt: skip
        if unknown:
            raise ValueError(f"{key}: unsupported key(s) {sorted(unknown)}")
        natural_dim = {"column": 0, "row": 1}.get(kind)  # output features of a column layer, inputs of a row
        if spec.get("partition_dim") not in (None, natural_dim):
            raise ValueError(
                f"{key}.partition_dim: {spec['partition_dim']!r} is not supported; a {kind} layer is split along "
                f"dim {natural_dim} of its weight"
                if natural_dim is not None
                else f"{key}.partition_dim: a skip layer is not split"
            )
        gather, grad_sum = bool(spec.get("gather_output", False)), bool(spec.get("grad_allreduce", False))
        if gather and kind != "column":
            raise ValueError(f"{key}.gather_output: applies to column layers only, not {kind!r}")
        if grad_sum and kind != "skip":
            raise ValueError(f"{key}.grad_allreduce: applies to skip layers only, not {kind!r}")
        model_types = spec.get("model_types")
        if model_types is not None:
            model_types = tuple(
                str(t).lower() for t in ([model_types] if isinstance(model_types, str) else model_types)
            )
        patterns = spec["patterns"] if isinstance(spec["patterns"], list) else [spec["patterns"]]
        try:
            compiled = tuple(re.compile(p) for p in patterns)
        except re.error as err:
            raise ValueError(f"{key}.patterns: bad regular expression ({err})") from err
        segments = _spec_segments(spec.get("shape"), key)
        parsed.append(PartitionRule(compiled, kind, segments, gather, grad_sum, model_types))
    return parsed


def _spec_segments(shape, key: str):
    if shape is None:
        return None
    first = shape[0] if isinstance(shape, (list, tuple)) and shape else None
    if isinstance(first, int) and first > 0:
        return first
    if isinstance(first, (list, tuple)) and all(isinstance(s, int) and s > 0 for s in first):
        return tuple(first)
    raise ValueError(
        f"{key}.shape: supported forms are (parts, -1) or ((size, size, ...), -1), got {shape!r}"
    )
