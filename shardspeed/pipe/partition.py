"""How a `PipelineModule`'s layers are split into contiguous stages: DeepSpeed's `partition_method`s.

- `uniform`: equal layer counts (the first stages take one more when they do not divide).
- `parameters`: balanced by trainable parameter count.
- `type:<regex>`: balanced by the number of layers whose class name matches the regex (case-insensitive),
  e.g. `type:transformer` puts the same number of transformer blocks on every stage.

Balancing is exact: among contiguous splits with at least one layer per stage, the one whose heaviest stage
is lightest (dynamic programming over split points, O(stages * layers^2), trivial for real layer counts).
Ties go to the split that puts more layers early, so every rank computes the same bounds.
"""

from __future__ import annotations

import re

__all__ = ["PartitionError", "balanced_bounds", "partition_layers", "uniform_bounds"]


class PartitionError(ValueError):
    """A partition that cannot be made: more stages than layers, a regex matching nothing, an unknown method."""


def uniform_bounds(num_items: int, num_parts: int) -> list[int]:
    """Bounds of `num_parts` contiguous parts of near-equal size: part i is items[bounds[i]:bounds[i+1]]."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def balanced_bounds(weights: list[int], num_parts: int) -> list[int]:
    """Contiguous split of `weights` into `num_parts` non-empty parts minimising the heaviest part."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: lightest possible heaviest part when the first i items form k parts; cut[k][i]: where part k starts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] or (cost == best[k][i] and j > cut[k][i]):
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def partition_layers(method: str, num_stages: int, layer_names: list[str], param_counts) -> list[int]:
    """Stage bounds for `method`; `param_counts()` (costly: builds every layer) is called only if needed."""
    num_layers = len(layer_names)
    if num_stages > num_layers:
        raise PartitionError(
            f"PipelineModule: {num_stages} stages but only {num_layers} layers; every stage needs a layer"
        )
    method = method.lower() if not method.lower().startswith("type:") else method
    if method == "uniform":
        return uniform_bounds(num_layers, num_stages)
    if method in ("parameters", "best"):
        return balanced_bounds(list(param_counts()), num_stages)
    if method.lower().startswith("type:"):
        pattern = method[len("type:") :]
        regex = re.compile(pattern, re.IGNORECASE)
        weights = [1 if regex.search(name) else 0 for name in layer_names]
        if not any(weights):
            raise PartitionError(
                f"partition_method {method!r}: the regex {pattern!r} matches no layer class "
                f"(layers: {sorted(set(layer_names))})"
            )
        return balanced_bounds(weights, num_stages)
    if method == "profile":
        raise NotImplementedError("partition_method 'profile' is not implemented (nor is it in DeepSpeed)")
    raise PartitionError(f"partition_method {method!r} is not one of 'uniform', 'parameters', 'type:<regex>'")
