"""`open_checkpoint`: a by-name reader of any checkpoint this library reads, chosen by the files' contents.

Two readers share one interface (`CheckpointReader`'s: `param_names()`, `shape()`, `fp32()`, `fp32_slice()`,
`optimizer_state()`, `optimizer_state_slice()`, `param_group_of()`, `param_groups()`, `loss_scaler()`,
`buffers()`, `frozen()`, `shared_params()`, ...):
- `CheckpointReader` (universal.py) for shardspeed's checkpoints;
- `DeepSpeedCheckpointReader` (deepspeed_format/read.py) for what DeepSpeed 0.19 writes.
The model-states file decides: DeepSpeed's records `ds_version` and no `shardspeed_version`.
"""

from __future__ import annotations

from pathlib import Path

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format import (
    DeepSpeedCheckpointReader,
    is_deepspeed_state,
    model_states_path,
)
from shardspeed.checkpoint.deepspeed_format.read import read_file
from shardspeed.checkpoint.universal import CheckpointReader, resolve_tag_dir

__all__ = ["open_checkpoint"]


def open_checkpoint(tag_dir, tag=None) -> CheckpointReader | DeepSpeedCheckpointReader:
    """The reader of one checkpoint: `tag_dir` is its tag folder, or the folder holding `latest` (then `tag`
    names the tag, read from `latest` when None). Raises `CheckpointError` naming what is wrong."""
    root = Path(tag_dir)
    path = root if tag is None and model_states_path(root).is_file() else resolve_tag_dir(root, tag)
    state = read_file(model_states_path(path), mmap=True)
    if is_deepspeed_state(state):
        return DeepSpeedCheckpointReader(path, model_states=state)
    if "param_shapes" not in state:
        raise files.CheckpointError(
            f"{model_states_path(path)} is neither a shardspeed nor a DeepSpeed 0.19 model-states file"
        )
    return CheckpointReader(path, model_states=state)
