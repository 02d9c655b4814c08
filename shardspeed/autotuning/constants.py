"""DeepSpeed's names for the `autotuning` block and the autotuner's search space (`deepspeed.autotuning.constants`).

The key names are DeepSpeed's; every default is read off the one config system's block
(`shardspeed.config.features.AutotuningConfig`), so the two never disagree. The tuning spaces are the ZeRO
knobs DeepSpeed tries per stage when `fast` is false; the metrics and names are the ones its files use.
"""

from __future__ import annotations

import dataclasses

from shardspeed.config.features import AutotuningConfig


def _default(name: str):
    field = next(f for f in dataclasses.fields(AutotuningConfig) if f.name == name)
    return field.default


AUTOTUNING = "autotuning"
AUTOTUNING_ENABLED = "enabled"
AUTOTUNING_ENABLED_DEFAULT = _default("enabled")
AUTOTUNING_FAST = "fast"
AUTOTUNING_FAST_DEFAULT = _default("fast")
AUTOTUNING_RESULTS_DIR = "results_dir"
AUTOTUNING_RESULTS_DIR_DEFAULT = _default("results_dir")
AUTOTUNING_EXPS_DIR = "exps_dir"
AUTOTUNING_EXPS_DIR_DEFAULT = _default("exps_dir")
AUTOTUNING_OVERWRITE = "overwrite"
AUTOTUNING_OVERWRITE_DEFAULT = _default("overwrite")
AUTOTUNING_START_PROFILE_STEP = "start_profile_step"
AUTOTUNING_START_PROFILE_STEP_DEFAULT = _default("start_profile_step")
AUTOTUNING_END_PROFILE_STEP = "end_profile_step"
AUTOTUNING_END_PROFILE_STEP_DEFAULT = _default("end_profile_step")
AUTOTUNING_METRIC_PATH = "metric_path"
AUTOTUNING_METRIC_PATH_DEFAULT = _default("metric_path")
AUTOTUNING_TUNER_TYPE = "tuner_type"
AUTOTUNING_TUNER_GRIDSEARCH = "gridsearch"
AUTOTUNING_TUNER_RANDOM = "random"
AUTOTUNING_TUNER_MODELBASED = "model_based"  # refused by the config block: no cost model is built
AUTOTUNING_TUNER_TYPE_DEFAULT = _default("tuner_type")
AUTOTUNING_TUNER_EARLY_STOPPING = "tuner_early_stopping"
AUTOTUNING_TUNER_EARLY_STOPPING_DEFAULT = _default("tuner_early_stopping")
AUTOTUNING_TUNER_NUM_TRIALS = "tuner_num_trials"
AUTOTUNING_TUNER_NUM_TRIALS_DEFAULT = _default("tuner_num_trials")
AUTOTUNING_ARG_MAPPINGS = "arg_mappings"
AUTOTUNING_ARG_MAPPINGS_DEFAULT = _default("arg_mappings")
AUTOTUNING_MAX_TRAIN_BATCH_SIZE = "max_train_batch_size"
AUTOTUNING_MAX_TRAIN_BATCH_SIZE_DEFAULT = _default("max_train_batch_size")
AUTOTUNING_MIN_TRAIN_BATCH_SIZE = "min_train_batch_size"
AUTOTUNING_MIN_TRAIN_BATCH_SIZE_DEFAULT = _default("min_train_batch_size")
AUTOTUNING_MAX_TRAIN_MICRO_BATCH_SIZE_PER_GPU = "max_train_micro_batch_size_per_gpu"
AUTOTUNING_MAX_TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = _default("max_train_micro_batch_size_per_gpu")
AUTOTUNING_MIN_TRAIN_MICRO_BATCH_SIZE_PER_GPU = "min_train_micro_batch_size_per_gpu"
AUTOTUNING_MIN_TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = _default("min_train_micro_batch_size_per_gpu")
AUTOTUNING_NUM_TUNING_MICRO_BATCH_SIZES = "num_tuning_micro_batch_sizes"
AUTOTUNING_NUM_TUNING_MICRO_BATCH_SIZES_DEFAULT = _default("num_tuning_micro_batch_sizes")
AUTOTUNING_MP_SIZE = "mp_size"
AUTOTUNING_MP_SIZE_DEFAULT = _default("mp_size")
AUTOTUNING_METRIC = "metric"
AUTOTUNING_METRIC_LATENCY = "latency"
AUTOTUNING_METRIC_THROUGHPUT = "throughput"
AUTOTUNING_METRIC_FLOPS = "flops"
AUTOTUNING_METRIC_DEFAULT = _default("metric")
AUTOTUNING_MODEL_INFO_PATH = "model_info_path"  # refused by the config block (no model-info profile run)
AUTOTUNING_MODEL_INFO_PATH_DEFAULT = None
MODEL_INFO = "model_info"  # refused by the config block (no model-info profile run)

# A larger micro-batch must beat the previous one by this fraction to count as better (else: a plateau).
METRIC_PERCENT_DIFF_CONST = 0.05
DS_CONFIG = "ds_config"  # an experiment's config, in its exps_dir JSON
GLOBAL_TUNING_SPACE = "global"  # the summary's row for the best experiment overall
TUNING_MICRO_BATCH_SIZE_PREFIX = "z"  # tuning spaces are named z<stage>

# The ZeRO knobs tried per stage when `fast` is false (DeepSpeed's spaces; lists are the candidates).
DEFAULT_TUNING_SPACE_ZERO_0 = {"zero_optimization": {"stage": 0}}
DEFAULT_TUNING_SPACE_ZERO_1 = {
    "zero_optimization": {
        "stage": 1,
        "reduce_bucket_size": [5e7, 5e8, 1e9],
        "allgather_bucket_size": [5e7, 5e8, 1e9],
    }
}
DEFAULT_TUNING_SPACE_ZERO_2 = {
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": [True, False],
        "reduce_scatter": [False, True],
        "reduce_bucket_size": [5e7, 5e8, 1e9],
        "allgather_bucket_size": [5e7, 5e8, 1e9],
        "contiguous_gradients": [False, True],
    }
}
DEFAULT_TUNING_SPACE_ZERO_3 = {
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": [True, False],
        "reduce_scatter": [False, True],
        "reduce_bucket_size": [5e7, 5e8, 1e9],
        "allgather_partitions": [True, False],
        "allgather_bucket_size": [5e7, 5e8, 1e9],
        "contiguous_gradients": [False, True],
    }
}
DEFAULT_TUNING_SPACES = {
    0: DEFAULT_TUNING_SPACE_ZERO_0,
    1: DEFAULT_TUNING_SPACE_ZERO_1,
    2: DEFAULT_TUNING_SPACE_ZERO_2,
    3: DEFAULT_TUNING_SPACE_ZERO_3,
}
