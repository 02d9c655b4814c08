"""A DeepSpeed model-states file seen through shardspeed's entries, so that the engine's checkpoint parts
(checkpoint/parts.py) load it as they load ours.

DeepSpeed and shardspeed share most entry names (`module`, `buffer_names`, `shared_params`, `lr_scheduler`,
`data_sampler`, the counters, `dp_world_size`, `ds_config`, `ds_version`). The rest is translated:
`param_shapes` (DeepSpeed: a list of {name: shape} per flat buffer, None at stage 0) becomes one {name: shape}
in the module's order, `zero_stage` comes from the saved config, `frozen_param_names` from
`frozen_param_shapes`, and `optimizer` is None: every value is read by name through
`DeepSpeedCheckpointReader`, which the model part opens from the original dict (`DeepSpeedView.raw`: an
attribute, not an entry, so that it is neither a part's entry nor the client's). A pipeline stage's file
(pipeline.py) gets its `module` from the layer files; `pipeline_stages` says how many stages were saved.
DeepSpeed's own bookkeeping entries (`checkpoint_parallel_dimensions`,
`frozen_param_fragments`, `random_ltd`, ...) are left out, so they are not handed back as client state;
every other entry is the client's, as in DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format.moe import DeepSpeedMoECheckpoint, is_deepspeed_moe_state
from shardspeed.checkpoint.deepspeed_format.pipeline import is_pipeline_state, with_stage_module
from shardspeed.checkpoint.deepspeed_format.read import (
    DeepSpeedCheckpointReader,
    is_deepspeed_state,
    model_states_path,
    read_file,
)

__all__ = ["DeepSpeedView", "deepspeed_raw", "engine_view", "read_model_states"]


class DeepSpeedView(dict):
    """A DeepSpeed model-states file under shardspeed's entries; `raw` is DeepSpeed's own dict (a pipeline
    stage's with its `module` rebuilt from the layer files), `pipeline_stages` the pipeline degree it was
    saved at (1 without a pipeline), `moe` the reader of an MoE checkpoint's experts and optimizer files."""

    raw: dict
    pipeline_stages: int = 1
    moe = None  # a DeepSpeedMoECheckpoint when the model had MoE layers


def deepspeed_raw(state) -> dict | None:
    """DeepSpeed's own model-states dict when `state` is the view of one, else None."""
    return state.raw if isinstance(state, DeepSpeedView) else None


# DeepSpeed's entries that are neither shardspeed's nor the client's (DeepSpeed 0.19's engine.py writes them).
_BOOKKEEPING = (
    "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "checkpoint_parallel_dimensions",
    "random_ltd", "sparse_tensor_module_names", "universal_checkpoint_info", "optimizer", "mp_world_size",
    "ds_autoep_layers", "autoep_layers",
)  # fmt: skip


def read_model_states(tag_dir: Path, mp_rank: int = 0) -> dict:
    """The model-states file of tag folder `tag_dir` read safely: ours as it is, DeepSpeed's in the engine's
    view. At tensor degree > 1 a checkpoint of a lower degree has only the first file (merged on load)."""
    path = model_states_path(tag_dir, mp_rank)
    if not path.is_file():
        path, mp_rank = model_states_path(tag_dir, 0), 0
    state = read_file(path)
    return engine_view(tag_dir, state, mp_rank) if is_deepspeed_state(state) else state


def engine_view(tag_dir: Path, raw: dict, mp_rank: int = 0) -> DeepSpeedView:
    """DeepSpeed's model-states dict `raw` with shardspeed's entries (see the module's docstring)."""
    stages = 1
    if is_pipeline_state(raw):  # stage `mp_rank` of a pipeline: its weights are in the layer files
        raw = with_stage_module(Path(tag_dir), raw, mp_rank, read_file)
        stages = int(raw["checkpoint_parallel_dimensions"]["pp_degree"])
    if is_deepspeed_moe_state(raw) and not is_pipeline_state(raw):
        return _moe_view(tag_dir, raw, mp_rank)
    reader = DeepSpeedCheckpointReader(tag_dir, model_states=raw, mp_rank=mp_rank)
    if int(raw.get("mp_world_size") or 1) != stages:
        raise files.CheckpointError(
            f"{model_states_path(Path(tag_dir), mp_rank)} was saved with a model-parallel degree of "
            f"{raw.get('mp_world_size')}; DeepSpeed's tensor-parallel files are not read by this version"
        )
    view = DeepSpeedView((k, v) for k, v in raw.items() if k not in _BOOKKEEPING)
    view.update(
        param_shapes=reader.param_shapes(),
        buffer_names=list(raw.get("buffer_names") or []),
        frozen_param_names=reader.frozen_param_names(),
        shared_params=reader.shared_params(),
        optimizer=None,
        zero_stage=reader.zero_stage,
        dp_world_size=reader.world_size,
    )
    view.raw = raw
    view.pipeline_stages = stages
    return view


def _moe_view(tag_dir: Path, raw: dict, mp_rank: int) -> DeepSpeedView:
    """A model with MoE layers: `param_shapes` lists the dense parameters, then every expert's under its global
    index (moe.py); the MoE part of the engine reads the values by name (the model part refuses them)."""
    reader = DeepSpeedMoECheckpoint(tag_dir, raw, mp_rank)
    if int(raw.get("mp_world_size") or 1) != 1:
        raise files.CheckpointError(
            f"{model_states_path(Path(tag_dir), mp_rank)} was saved with a model-parallel degree of "
            f"{raw.get('mp_world_size')}; DeepSpeed's tensor-parallel MoE files are not read by this version"
        )
    view = DeepSpeedView((k, v) for k, v in raw.items() if k not in _BOOKKEEPING)
    view.update(
        param_shapes=dict(reader.param_shapes()),
        buffer_names=list(raw.get("buffer_names") or []),
        frozen_param_names=[],
        shared_params=dict(raw.get("shared_params") or {}),
        optimizer=None,
        zero_stage=reader.zero_stage,
        dp_world_size=reader.world_size,
    )
    view.raw = raw
    view.moe = reader
    return view
