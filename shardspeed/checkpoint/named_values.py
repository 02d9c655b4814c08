"""What every checkpoint reader answers the same way, whatever layout it reads.

`CheckpointReader` (ours), `DeepSpeedCheckpointReader` (DeepSpeed's files) and `UniversalFolderReader`
(a universal folder) present a checkpoint by parameter name. Each keeps `self._shapes` (name -> torch.Size, in
the model's order) and `self.path`; the name lookups below are defined once on that. Readers whose values come
from one `_slice(name, lo, hi)` in the saved dtype (elements [lo, hi) of the flattened value, gathered from
the rank files) also take `fp32`, `fp32_slice` and `frozen` from `SlicedValues`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NamedParameters", "SlicedValues", "numel"]


def numel(shape) -> int:
    """The element count of a saved shape (a torch.Size, list or tuple)."""
    return math.prod(int(d) for d in shape)


class NamedParameters:
    """Name lookups over `self._shapes`; `_described_as` words the error for an unknown name."""

    _described_as = "checkpoint"

    def param_names(self) -> list[str]:
        """Every parameter (trainable and frozen, tied ones once), in the model's order."""
        return list(self._shapes)

    def param_shapes(self) -> dict[str, torch.Size]:
        return dict(self._shapes)

    def shape(self, name: str) -> torch.Size:
        self._check_name(name)
        return self._shapes[name]

    def _check_name(self, name: str) -> None:
        if name not in self._shapes:
            raise KeyError(f"{name!r} is not a parameter of {self._described_as} {self.path}")


class SlicedValues(NamedParameters):
    """Values read through the reader's `_slice(name, lo, hi)`."""

    def fp32(self, name: str) -> torch.Tensor:
        """The full fp32 value of parameter `name` (the master weight when trained in fp16/bf16)."""
        return self.fp32_slice(name, 0, numel(self.shape(name))).view(self._shapes[name])

    def fp32_slice(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened fp32 value of `name`, as a new 1-D tensor."""
        return self._slice(name, lo, hi).float()

    def frozen(self, name: str) -> torch.Tensor:
        """The saved value of a parameter, in the dtype it was trained in (for frozen parameters)."""
        return self._slice(name, 0, numel(self.shape(name))).view(self._shapes[name])
