"""The data analyzer's output for one metric, in the files the curriculum sampler reads.

DeepSpeed's `DataAnalyzer` computes a metric per sample (a map over the dataset, in parallel workers) and
writes, under `<save_path>/<metric>/`:

- `<metric>_sample_to_metric`: row i is sample i's value;
- `<metric>_index_to_sample`: one row per distinct value, ascending: the samples having it, in index order;
- `<metric>_index_to_metric`: one row per distinct value: the value itself.

`write_metric_index` writes those three from values already computed (DeepSpeed's analyzer itself, its
worker/thread map-reduce, is not built: `deepspeed.runtime.data_pipeline.data_sampling.data_analyzer` is
refused by name). Point `index_to_sample_path` / `index_to_metric_path` of a curriculum metric at the
returned prefixes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .indexed_dataset import find_fit_int_dtype, write_rows

__all__ = ["write_metric_index"]


def write_metric_index(save_path: str | os.PathLike, metric_name: str, values) -> dict[str, str]:
    """Write the analyzer's three files for `values` (one integer per sample, in sample order: a tensor or a
    sequence); returns {"sample_to_metric" | "index_to_sample" | "index_to_metric": path prefix}."""
    values = torch.as_tensor(values).reshape(-1)
    if values.numel() == 0 or values.is_floating_point() or values.is_complex():
        raise ValueError(
            f"metric {metric_name!r}: needs one integer value per sample, got {values.dtype} x {values.numel()}"
        )
    values = values.long()
    folder = Path(save_path) / metric_name
    folder.mkdir(parents=True, exist_ok=True)
    value_dtype = find_fit_int_dtype(int(values.min()), int(values.max()))
    sample_dtype = find_fit_int_dtype(0, len(values))
    order = torch.sort(values, stable=True).indices  # samples by value, index order within a value
    distinct, counts = torch.unique_consecutive(values[order], return_counts=True)
    groups = order.split(counts.tolist())
    kinds = ("sample_to_metric", "index_to_sample", "index_to_metric")
    prefixes = {kind: str(folder / f"{metric_name}_{kind}") for kind in kinds}
    write_rows(prefixes["sample_to_metric"], ([v] for v in values.tolist()), value_dtype)
    write_rows(prefixes["index_to_sample"], groups, sample_dtype)
    write_rows(prefixes["index_to_metric"], ([v] for v in distinct.tolist()), value_dtype)
    return prefixes
