"""DeepSpeed's `deepspeed.checkpoint.constants`: the names of checkpoint entries, files and universal-checkpoint
metadata that DeepSpeed's tests and Megatron-DeepSpeed import (also added to `deepspeed.checkpoint` itself, as
DeepSpeed's package re-exports them). Values are DeepSpeed 0.19.8's, so a dict built with them means the same
in either library; shardspeed's universal folders (checkpoint/universal_folder.py) use these entries.
"""

from __future__ import annotations

__all__ = [
    "AUTOEP_LAYERS_KEY", "AUTOEP_LAYERS_KEY_LEGACY", "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS", "BASE_OPTIMIZER_STATE", "BASE_OPTIMIZER_STATE_STEP",
    "BF16_ZERO_FILE_PREFIX", "BUFFER_NAMES", "CAT_DIM", "CHECKPOINT_PARALLEL_DIMS", "CHECKPOINT_PP_DEGREE",
    "CHECKPOINT_TP_DEGREE", "CLIP_GRAD", "DS_AUTOTP_UC_META", "DS_VERSION",
    "FP16_ZERO_FILE_PREFIX", "FP32_FLAT_GROUPS", "FP32_GROUPS", "FP32_WEIGHT_KEY", "FROZEN_PARAM_FRAGMENTS",
    "FROZEN_PARAM_SHAPES", "GROUP_PADDINGS", "LAYER_FILE_PREFIX", "LOSS_SCALER", "MODEL_FILE_PREFIX",
    "MODEL_FILE_SUFFIX", "OPTIMIZER_STATE_DICT", "OPTIM_FILE_SUFFIX", "ORIGINAL_VOCAB_SIZE", "PADDED_VOCAB_SIZE",
    "PARAM", "PARAMETER_TO_AVERAGE_PATTERNS", "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0",
    "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "PARAMETER_WITH_SUB_PARAMS", "PARAM_GROUPS", "PARAM_N_SUB_PARAMS",
    "PARAM_SHAPES", "PARAM_SLICE_MAPPINGS", "PARTITION_COUNT", "PIPELINE_REPLICATED_PARAMETER_PATTERNS",
    "SINGLE_PARTITION_OF_FP32_GROUPS", "SUB_PARAMS_SHAPE", "SUB_PARAM_SHAPE", "SUB_PARAM_SHARD_WIDTHS",
    "TP_REPLICATED_PARAMETER_PATTERNS", "UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY",
    "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "VOCABULARY_PARAMETER_PATTERNS", "VOCAB_TENSOR", "ZERO_FILE_PREFIX",
    "ZERO_STAGE",
]  # fmt: skip

# -- entries of the optimizer (ZeRO partition) files -----------------------------------------------------------
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"  # a universal parameter folder's fp32.pt
LOSS_SCALER = "loss_scaler"

# -- entries of the model-states file ----------------------------------------------------------------------------
PARAM = "param"  # the value's key in each universal state file
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"

# -- file names --------------------------------------------------------------------------------------------------
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"
DS_VERSION = "ds_version"

# -- universal checkpoints ---------------------------------------------------------------------------------------
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
# AutoTP's entries: the attribute naming a parameter's universal-checkpoint metadata, and the universal info
# key listing parameter patterns (with the reason) whose tensor-parallel layout cannot be merged
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
SUB_PARAMS_SHAPE = "sub_params_shape"
# Megatron-DeepSpeed's patterns of parameters that need care when merging tensor-parallel slices.
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"

# -- AutoEP: the model-states entry `ds_autoep_layers` (one dict per AutoEP layer) and its fields, as shardspeed's
# AutoEP checkpoints write and check them (moe/autoep_checkpoint.py); "zero3_partitioned" names DeepSpeed's ZeRO-3
# expert layout, which shardspeed neither writes nor reads (AutoEP refuses ZeRO stage 3)
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_EXPERT_KEY_PREFIX = "expert_key_prefix"
AUTOEP_NUM_EXPERTS = "num_experts"
AUTOEP_NUM_LOCAL_EXPERTS = "num_local_experts"
AUTOEP_EP_SIZE = "ep_size"
AUTOEP_ZERO12_REQUIRED_FIELDS = (
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_NUM_EXPERTS,
    AUTOEP_NUM_LOCAL_EXPERTS,
    AUTOEP_EP_SIZE,
)
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY = "checkpoint_format"
AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT = "zero3_partitioned"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY = "checkpoint_format_version"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION = 1
__all__ += [
    "AUTOEP_EP_SIZE",
    "AUTOEP_EXPERT_KEY_PREFIX",
    "AUTOEP_LAYERS_KEY",
    "AUTOEP_LAYERS_KEY_LEGACY",
    "AUTOEP_NUM_EXPERTS",
    "AUTOEP_NUM_LOCAL_EXPERTS",
    "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY",
    "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION",
    "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY",
    "AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT",
    "AUTOEP_ZERO12_REQUIRED_FIELDS",
]  # fmt: skip
# -- the folding metadata of AutoEP-folded-onto-AutoTP checkpoints (names only: saving a model with AutoEP
# layers is refused, so shardspeed writes no such entry; they import for code that reads DeepSpeed's)
__all__ += [
    "FOLDING_DISPATCH_STRATEGY", "FOLDING_EP_RANK", "FOLDING_EP_SIZE", "FOLDING_ETP_RANK", "FOLDING_ETP_SIZE",
    "FOLDING_FAMILY", "FOLDING_METADATA_KEY", "FOLDING_METADATA_VERSION", "FOLDING_PARAM_FAMILIES",
    "FOLDING_SHARED_EXPERT_PLACEMENT", "FOLDING_TP_RANK", "FOLDING_TP_SIZE", "FOLDING_ZERO_PARTITION_COUNT",
    "FOLDING_ZERO_PARTITION_GROUP", "FOLDING_ZERO_PARTITION_RANK",
]  # fmt: skip
FOLDING_METADATA_KEY = "folding"
FOLDING_METADATA_VERSION = 1
FOLDING_TP_SIZE = "tp_size"
FOLDING_TP_RANK = "tp_rank"
FOLDING_EP_SIZE = "ep_size"
FOLDING_EP_RANK = "ep_rank"
FOLDING_ETP_SIZE = "etp_size"
FOLDING_ETP_RANK = "etp_rank"
FOLDING_ZERO_PARTITION_GROUP = "zero_partition_group"
FOLDING_ZERO_PARTITION_RANK = "zero_partition_rank"
FOLDING_ZERO_PARTITION_COUNT = "zero_partition_count"
FOLDING_DISPATCH_STRATEGY = "dispatch_strategy"
FOLDING_SHARED_EXPERT_PLACEMENT = "shared_expert_placement"
FOLDING_FAMILY = "family"
FOLDING_PARAM_FAMILIES = "param_families"
