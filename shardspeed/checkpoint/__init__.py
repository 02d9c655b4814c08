"""Model checkpoints: engine save/load, resharding across world sizes and stages, fp32 consolidation."""

from shardspeed.checkpoint.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.universal import CheckpointReader

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]
