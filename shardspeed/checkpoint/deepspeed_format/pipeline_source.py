"""shardspeed's own pipeline checkpoints, stage by stage, for writing them in DeepSpeed 0.19.8's layout (write.py).

A shardspeed pipeline checkpoint has DeepSpeed's file names (pipe/checkpoint.py): `layer_XX-model_states.pt` per
layer, `mp_rank_SS_model_states.pt` per stage (with `module` None and a `pipeline` entry: the stage count, the
partition, each layer's parameter prefix) and, at ZeRO stage 1, `zero_pp_rank_D_mp_rank_SS_optim_states.pt`.
Each stage is presented as a `CheckpointReader` over its model-states entries with `module` rebuilt from its
layer files, so that the writer reads it by name as it reads a whole checkpoint.

What DeepSpeed's PipelineModule could not load is refused naming the file: tied layers (their parameters live
under `tied_modules.*`, which DeepSpeed's layer files do not name) and layer files with a rank suffix (tensor
parallelism inside the pipeline).
"""

from __future__ import annotations

from pathlib import Path

from shardspeed.checkpoint import files
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.universal import CheckpointReader

__all__ = ["layer_file_names", "stage_sources"]


def _layers(path: Path, state: dict) -> list[tuple[int, str]]:
    """The stage's (global layer index, parameter prefix) pairs, checked writable in DeepSpeed's layout."""
    meta = state["pipeline"]
    if meta.get("rank_repr"):
        raise CheckpointError(
            f"{path} has layer files with the rank suffix {meta['rank_repr']!r} (tensor parallelism inside the "
            "pipeline): not written in DeepSpeed's layout by this version"
        )
    layers = [(int(index), prefix) for index, prefix in meta["layer_prefixes"].items()]
    tied = [prefix for index, prefix in layers if prefix != f"{index}."]
    if tied:
        raise CheckpointError(
            f"{path} holds tied layers ({tied[:3]}): DeepSpeed's pipeline layout of tied modules is not written "
            "by this version"
        )
    return sorted(layers)


def layer_file_names(tag_dir: Path, state: dict) -> list[str]:
    """The layer files of one stage (DeepSpeed's names: `layer_XX-model_states.pt`)."""
    return [f"layer_{index:02d}-model_states.pt" for index, _ in _layers(Path(tag_dir), state)]


def stage_sources(tag_dir: Path) -> list[tuple[CheckpointReader, dict]]:
    """Every stage's (by-name reader, model-states entries) of a shardspeed pipeline checkpoint."""
    tag_dir = Path(tag_dir)
    first = files.load_file(tag_dir / files.model_states_name(0))
    stages = int(first["pipeline"]["num_stages"])
    out = []
    for stage in range(stages):
        path = tag_dir / files.model_states_name(stage)
        state = first if stage == 0 else files.load_file(path)
        if (state.get("pipeline") or {}).get("stage") != stage:
            raise CheckpointError(f"{path} is not stage {stage}'s model-states file of a pipeline checkpoint")
        module = {}
        for index, prefix in _layers(path, state):
            layer = files.load_file(tag_dir / f"layer_{index:02d}-model_states.pt")
            module.update({prefix + key: value for key, value in layer.items()})
        reader = CheckpointReader(tag_dir, model_states=dict(state, module=module), mp_rank=stage)
        out.append((reader, state))
    return out
