"""AutoTP's layer rules as objects (DeepSpeed 0.19.8's `module_inject.autotp_config` names).

`TPLayerSpec` is one rule: regex `patterns` matched against parameter names (`layers.0.mlp.up_proj.weight`),
a `PartitionType` (column, row, skip) and optional `shape` (fused parts), `gather_output` (a column layer
whose output every rank receives whole) and `grad_allreduce` (a skipped parameter whose gradient is summed
over the tensor group). `AutoTPConfig` holds a list of them, as the `tensor_parallel.partition_config` block
does; `from_dict` reads that block. `shard_model` takes either form (`as_layer_spec_dicts`), so the dict in a
JSON config and the objects a program builds place layers the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["AutoTPConfig", "PartitionType", "TPLayerSpec"]


class PartitionType(Enum):
    """Where a layer's weight is cut: output features (column), input features (row), or not at all (skip)."""

    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


def _as_tuple(shape):
    """JSON gives lists; the shape is tuples (one level of nesting: the fused parts' sizes)."""
    if isinstance(shape, list):
        return tuple(_as_tuple(item) for item in shape)
    return shape


@dataclass
class TPLayerSpec:
    """One placement rule. The first spec whose pattern matches a parameter's name places its layer."""

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: tuple | None = None
    """Column layers: `(parts, -1)` for equal fused parts, `((q, k, v), -1)` for unequal ones."""
    partition_dim: int | None = None
    """0 for a column layer, 1 for a row layer (the only layouts AutoTP shards); None = that default."""
    model_types: list[str] | None = None
    """Only for models whose `config.model_type` is one of these (case-insensitive)."""
    gather_output: bool = False
    """Column layers: all-gather the output so every rank gets all features (an untied LM head)."""
    grad_allreduce: bool = False
    """Skip layers: sum the parameters' gradients over the tensor group (they see sharded activations)."""

    def __post_init__(self):
        if isinstance(self.patterns, str):
            self.patterns = [self.patterns]
        if isinstance(self.partition_type, str):
            self.partition_type = PartitionType(self.partition_type.lower())
        self.shape = _as_tuple(self.shape)
        if self.gather_output and self.partition_type is not PartitionType.COLUMN:
            raise ValueError(f"TPLayerSpec{self.patterns}: gather_output applies to column layers only")
        if self.grad_allreduce and self.partition_type is not PartitionType.SKIP:
            raise ValueError(f"TPLayerSpec{self.patterns}: grad_allreduce applies to skip layers only")
        for pattern in self.patterns:
            re.compile(pattern)  # a bad regex fails here, naming itself

    def get_partition_dim(self) -> int:
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type is PartitionType.COLUMN else 1

    def matches(self, param_name: str, model_type: str | None = None) -> bool:
        if self.model_types:
            wanted = {str(t).lower() for t in self.model_types}
            if model_type is None or str(model_type).lower() not in wanted:
                return False
        return any(re.match(pattern, param_name) for pattern in self.patterns)

    def as_dict(self) -> dict:
        """The `partition_config.layer_specs` entry this spec stands for."""
        out = {"patterns": list(self.patterns), "partition_type": self.partition_type.value}
        for key in ("shape", "partition_dim", "model_types"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.gather_output:
            out["gather_output"] = True
        if self.grad_allreduce:
            out["grad_allreduce"] = True
        return out


@dataclass
class AutoTPConfig:
    """A `partition_config`: the layer rules, and whether AutoTP's built-in names apply after them."""

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    use_default_specs: bool = True
    strict_mode: bool = False
    """Accepted for DeepSpeed configs: shardspeed always refuses a linear inside a block that no rule places."""

    def find_matching_spec(self, param_name: str, model_type: str | None = None) -> TPLayerSpec | None:
        return next((s for s in self.layer_specs if s.matches(param_name, model_type)), None)

    def as_layer_spec_dicts(self) -> list[dict]:
        return [spec.as_dict() for spec in self.layer_specs]

    @classmethod
    def from_dict(cls, config: dict) -> AutoTPConfig:
        """The `tensor_parallel.partition_config` block (plus `tp_size`) as an object; unknown keys are refused."""
        known = {"tp_size", "layer_specs", "use_default_specs", "strict_mode"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"partition_config: unsupported key(s) {unknown}; valid keys: {sorted(known)}")
        spec_keys = {"patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output",
                     "grad_allreduce"}  # fmt: skip
        specs = []
        for i, entry in enumerate(config.get("layer_specs", [])):
            if isinstance(entry, TPLayerSpec):
                specs.append(entry)
                continue
            extra = sorted(set(entry) - spec_keys)
            if extra:
                raise ValueError(f"partition_config.layer_specs[{i}]: unsupported key(s) {extra}")
            specs.append(TPLayerSpec(**{k: entry[k] for k in spec_keys if k in entry}))
        return cls(
            tp_size=config.get("tp_size", 1),
            layer_specs=specs,
            use_default_specs=config.get("use_default_specs", True),
            strict_mode=config.get("strict_mode", False),
        )
