"""DeepSpeed 0.19's pipeline checkpoints (what its PipelineEngine writes), read stage by stage.

A tag folder of a DeepSpeed pipeline run holds (learnt from DeepSpeed's pipe/module.py and engine.py):
- `layer_XX-model_states.pt`: the state dict of global layer XX (one file per layer, parameterless layers
  included, written by the data-parallel rank 0 of the stage holding it; no rank suffix without tensor
  parallelism);
- `mp_rank_SS_model_states.pt`, one per stage SS: the usual model-states entries with `module` None,
  `param_shapes` naming the stage's parameters (`"<layer>.<param>"`), `mp_world_size` = stages x tensor degree,
  and `checkpoint_parallel_dimensions` = {pp_degree, tp_degree};
- `zero_pp_rank_D_mp_rank_SS_optim_states.pt`: ZeRO-1 partition D of stage SS, in the flat layout of layout.py.

DeepSpeed records no partition bounds: the layers of stage SS are read off the parameter and buffer names of
its model-states file. `stage_states` returns each stage's model-states dict with its `module` rebuilt from
the layer files, so that `DeepSpeedCheckpointReader(tag_dir, model_states=..., mp_rank=SS)` reads that stage
by parameter name. What this version does not read (ZeRO stage 0, whose files record no parameter names;
tied layers; tensor parallelism inside the pipeline) is refused naming the file.
"""

from __future__ import annotations

from pathlib import Path

from shardspeed.checkpoint.files import CheckpointError

__all__ = ["is_pipeline_state", "layer_file", "stage_states", "with_stage_module"]


def is_pipeline_state(raw: dict) -> bool:
    """Whether a DeepSpeed model-states dict is a pipeline stage's (its weights are in layer files)."""
    dims = raw.get("checkpoint_parallel_dimensions") or {}
    return raw.get("module") is None and int(dims.get("pp_degree") or 1) > 1


def layer_file(tag_dir: Path, index: int) -> Path:
    return Path(tag_dir) / f"layer_{index:02d}-model_states.pt"


def _stage_path(tag_dir: Path, stage: int) -> Path:
    return Path(tag_dir) / f"mp_rank_{stage:02d}_model_states.pt"


def _layer_indices(path: Path, raw: dict) -> list[int]:
    """The global layer indices of one stage, from its parameter and buffer names."""
    shapes = raw.get("param_shapes")
    if not isinstance(shapes, list):
        zero = ((raw.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
        raise CheckpointError(
            f"{path} is a DeepSpeed pipeline stage saved at ZeRO stage {zero}, which records no parameter names "
            "(no 'param_shapes'): this version reads DeepSpeed pipeline checkpoints saved at ZeRO stage 1"
        )
    names = [n for group in shapes for n in group] + list(raw.get("buffer_names") or [])
    names += list(raw.get("frozen_param_shapes") or {})
    indices = set()
    for name in names:
        head = name.split(".", 1)[0]
        if not head.isdigit():
            raise CheckpointError(
                f"{path} names parameter {name!r}, not '<layer index>.<name>': tied layers (tied_modules.*) of "
                "DeepSpeed pipeline checkpoints are not read by this version"
            )
        indices.add(int(head))
    return sorted(indices)


def with_stage_module(tag_dir: Path, raw: dict, stage: int, read_file) -> dict:
    """Stage `stage`'s model-states dict `raw` with `module` rebuilt from its layer files (read by
    `read_file`, the safe reader of read.py); the dict itself is left as it was."""
    path = _stage_path(tag_dir, stage)
    dims = raw.get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("tp_degree") or 1) != 1:
        raise CheckpointError(
            f"{path} was saved with tensor parallelism {dims.get('tp_degree')} inside the pipeline; this version "
            "reads DeepSpeed pipeline checkpoints without tensor parallelism"
        )
    module = {}
    for index in _layer_indices(path, raw):
        source = layer_file(tag_dir, index)
        if not source.is_file():
            raise CheckpointError(
                f"DeepSpeed pipeline checkpoint {tag_dir} is incomplete: {path.name} names layer {index}'s "
                f"parameters, but {source.name} is missing"
            )
        module.update({f"{index}.{key}": value for key, value in read_file(source).items()})
    return dict(raw, module=module)


def stage_states(tag_dir: Path, read_file) -> list[dict]:
    """Every stage's model-states dict, each with its `module` from the layer files (see the docstring)."""
    tag_dir = Path(tag_dir)
    first = read_file(_stage_path(tag_dir, 0))
    stages = int((first.get("checkpoint_parallel_dimensions") or {}).get("pp_degree") or 1)
    out = []
    for stage in range(stages):
        path = _stage_path(tag_dir, stage)
        if not path.is_file():
            raise CheckpointError(
                f"DeepSpeed pipeline checkpoint {tag_dir} is incomplete: it records {stages} stages, but "
                f"{path.name} is missing"
            )
        raw = first if stage == 0 else read_file(path)
        if not is_pipeline_state(raw):
            raise CheckpointError(
                f"{path} is not a DeepSpeed pipeline stage's model-states file (expected module None and "
                "checkpoint_parallel_dimensions.pp_degree > 1)"
            )
        out.append(with_stage_module(tag_dir, raw, stage, read_file))
    return out
