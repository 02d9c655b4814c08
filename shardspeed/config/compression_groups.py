"""``compression_training``'s groups: ``different_groups.<name>`` = which modules, with which ``params``.

One group class per technique (its ``params`` differ); ``modules`` / ``related_modules`` are shared and their
regular expressions are checked here, so a bad pattern is refused with its key path. See compression.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

from .blocks import NonNegInt, PositiveInt
from .build import Key, join, show
from .errors import ConfigError

__all__ = [
    "ActivationQuantizationGroup",
    "PruningGroup",
    "WeightQuantizationGroup",
]

DenseRatio = Annotated[float, Key(gt=0, le=1)]


# ---- groups: which modules, with which parameters ------------------------------------------------------


@dataclass(kw_only=True)
class _Group:
    modules: list[str] = field(default_factory=lambda: ["*"])
    """Regular expressions searched (``re.search``) in module names; "*" = every Linear and Conv2d. Default ["*"]."""
    related_modules: list[list[str]] | None = None
    """Per ``modules`` entry, the modules whose input dimension shrinks with its pruned outputs. Default null."""

    def validate(self, path: str) -> None:
        if not self.modules:
            raise ConfigError(f"{join(path, 'modules')}: empty list; name at least one module pattern")
        patterns = [(f"modules[{i}]", p) for i, p in enumerate(self.modules)]
        for i, related in enumerate(self.related_modules or []):
            patterns += [(f"related_modules[{i}][{j}]", p) for j, p in enumerate(related)]
        for key, pattern in patterns:
            if pattern == "*":
                continue
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(
                    f"{join(path, key)}: {show(pattern)} is not a regular expression ({err})"
                ) from None
        if self.related_modules is not None and len(self.related_modules) != len(self.modules):
            raise ConfigError(
                f"{join(path, 'related_modules')}: {len(self.related_modules)} list(s) for "
                f"{len(self.modules)} 'modules' entries; give one list of related patterns per entry"
            )


@dataclass(kw_only=True)
class WeightQuantizationParams:
    """``weight_quantization.different_groups.<name>.params``."""

    start_bits: Annotated[int, Key(ge=1, le=32)]
    """Bits at the start of MoQ's schedule (quantize_weight_in_forward false, not built); quantizing in
    forward uses target_bits from the start, as 0.18.9 does, and a value other than target_bits is warned.
    Required."""
    target_bits: Annotated[int, Key(ge=1, le=32)]
    """Bits at the end: 1 = binary, 2 = ternary (XTC), >= 3 = integer grid. Required."""
    quantization_period: NonNegInt = 1
    """MoQ's steps before the first bit is dropped, the period doubling after each drop; unused in forward (as
    in 0.18.9). Default 1."""
    quantize_groups: PositiveInt | None = None
    """This group's quantize_groups, over the shared one (beyond 0.18.9, where the shared value always wins:
    modules of different sizes need different counts for equal runs). Default null."""

    def validate(self, path: str) -> None:
        if self.start_bits < self.target_bits:
            raise ConfigError(
                f"{join(path, 'start_bits')}: {self.start_bits} is below target_bits {self.target_bits}; "
                f"bits only go down over the schedule"
            )


@dataclass(kw_only=True)
class WeightQuantizationGroup(_Group):
    """One weight-quantization group."""

    params: WeightQuantizationParams
    """start_bits, target_bits, quantization_period. Required."""


@dataclass(kw_only=True)
class ActivationQuantizationParams:
    """``activation_quantization.different_groups.<name>.params``."""

    bits: Literal[4, 8]
    """Bits of the quantized layer inputs (0.18.9 supports 4 and 8). Required."""


@dataclass(kw_only=True)
class ActivationQuantizationGroup(_Group):
    """One activation-quantization group."""

    params: ActivationQuantizationParams
    """bits. Required."""


@dataclass(kw_only=True)
class PruningParams:
    """``<pruning>.different_groups.<name>.params``."""

    dense_ratio: DenseRatio
    """Fraction of weights / rows / heads / channels kept, in (0, 1]. Required."""


@dataclass(kw_only=True)
class PruningGroup(_Group):
    """One pruning group."""

    params: PruningParams
    """dense_ratio. Required."""
