"""The data-efficiency library: curriculum learning (a scheduler, a sampler over metric-indexed data) and
random layerwise token dropping (random-LTD), with DeepSpeed's names and values (docs/configuration.md,
"data_efficiency"). `engine_part.DataEfficiency` is what the engine holds; the modules:

- `curriculum_scheduler`: the difficulty at each step (fixed_linear, fixed_root, fixed_discrete, custom);
- `sampler`, `clusters`, `loader`: curriculum batches from the samples a difficulty allows;
- `indexed_dataset`, `metric_index`: the data analyzer's files (Megatron's MMIDIDX layout);
- `random_ltd/`: the layer wrapper, its scheduler, model conversion, token gather/scatter.
"""

from .curriculum_scheduler import CurriculumScheduler
from .engine_part import DataEfficiency
from .indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, find_fit_int_dtype
from .loader import CurriculumDataLoader
from .metric_index import write_metric_index
from .random_ltd import (
    RandomLayerTokenDrop,
    RandomLTDScheduler,
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from .sampler import DeepSpeedDataSampler

__all__ = [
    "CurriculumDataLoader",
    "CurriculumScheduler",
    "DataEfficiency",
    "DeepSpeedDataSampler",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "RandomLTDScheduler",
    "RandomLayerTokenDrop",
    "convert_to_random_ltd",
    "find_fit_int_dtype",
    "remove_random_ltd_state_dict",
    "save_without_random_ltd",
    "write_metric_index",
]
