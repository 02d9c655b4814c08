"""Pipeline checkpoints: DeepSpeed's per-layer files, and loading at another pipeline or data degree.

Layout of `<save_dir>/<tag>/` (DeepSpeed's names, reference §3.1):

    layer_XX-model_states.pt                    one layer's weights (XX: global layer index), by data rank 0
                                                of the stage that holds the layer
    mp_rank_SS_model_states.pt                  stage SS: counters, scheduler, config, partition bounds;
                                                `module` is None (weights are in the layer files); at ZeRO
                                                stage 0 also the stage's optimizer state
    zero_pp_rank_D_mp_rank_SS_optim_states.pt   ZeRO-1: data rank D's optimizer partition of stage SS
    rng_states_rank_R.pt                        every rank's RNG streams

Loading with the same number of stages, the same partition and the same data degree restores every rank's
own files and resumes bit for bit. Anything else (beyond DeepSpeed, which needs an offline conversion) is
read by parameter name: parameter names are global layer indices, so they do not depend on the partition;
each saved stage's files are presented through a `CheckpointReader`, and the optimizer wrapper's
`load_universal` picks the values and optimizer states of the parameters this rank now holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardspeed.checkpoint import files, verify
from shardspeed.checkpoint.engine_io import (
    ENGINE_KEYS,
    _load_progress,
    _model_states,
    _rng_state,
    _set_rng_state,
    saving,
)
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.universal import CheckpointReader
from shardspeed.utils.logging import log_dist

__all__ = ["layer_file_name", "load_pipeline_checkpoint", "save_pipeline_checkpoint"]


def layer_file_name(index: int, rank_repr: str = "") -> str:
    return f"layer_{index:02d}{'-' + rank_repr if rank_repr else ''}-model_states.pt"


def _layer_prefixes(module) -> dict[int, str]:
    """Global layer index -> the prefix of its parameters in the module ("3." or "tied_modules.embed.")."""
    prefixes = {}
    for index, layer in module.local_layers():
        key = next((k for k, m in module.tied_modules.items() if m is layer), None)
        prefixes[index] = f"tied_modules.{key}." if key is not None else f"{index}."
    return prefixes


def save_pipeline_checkpoint(engine, save_dir, tag, client_state, save_latest, exclude_frozen) -> bool:
    with saving(engine, save_dir, tag, client_state, save_latest) as (save_dir, tag, staging):
        _write_stage_files(engine, staging, client_state, exclude_frozen)
    log_dist(f"saved pipeline checkpoint {save_dir / tag}")
    return True


def _write_stage_files(engine, staging, client_state, exclude_frozen) -> None:
    """This rank's files: its stage's layer files (data-parallel rank 0), partition and RNG state."""
    rank, stage, module = dist.get_rank(), engine.stage_id, engine.module
    rank_repr = module.topology().get_rank_repr(rank)
    if engine.dp_rank == 0:
        for index, layer in module.local_layers():
            files.save_file(layer.state_dict(), staging / layer_file_name(index, rank_repr))
        state = _model_states(engine, client_state, exclude_frozen)
        state["module"] = None  # as DeepSpeed: the weights live in the layer files
        state["mp_world_size"] = engine.num_stages
        state["pipeline"] = {
            "num_stages": engine.num_stages,
            "stage": stage,
            "parts": list(module.parts),
            "layer_prefixes": _layer_prefixes(module),
            "rank_repr": rank_repr,
        }
        files.save_file(state, staging / files.model_states_name(stage))
    if engine.optimizer is not None and engine.optimizer.zero_stage > 0:
        partition = {"optimizer_state_dict": engine.optimizer.state_dict(), "ds_config": engine.config}
        files.save_file(partition, staging / files.zero_optim_states_name(engine.dp_rank, stage))
    files.save_file(_rng_state(), staging / files.rng_states_name(rank))


class _StageReader(CheckpointReader):
    """One saved stage's files as a `CheckpointReader` (its partition files carry the stage's mp_rank)."""

    def __init__(self, path: Path, state: dict, stage: int):
        self._stage = stage
        super().__init__(path, model_states=state)

    def _rank_path(self, rank: int) -> Path:
        return self.path / files.zero_optim_states_name(rank, self._stage)


class _PipelineReader:
    """Every saved stage's reader behind one by-name interface (what `load_universal` asks of a reader)."""

    def __init__(self, readers: list[CheckpointReader]):
        self.readers = readers
        self.zero_stage = readers[0].zero_stage
        self.world_size = readers[0].world_size
        self._owner = {}
        for reader in readers:
            for name in reader.param_names():
                self._owner.setdefault(name, reader)  # a tied weight: every holder saved the same value

    def __getattr__(self, attr):
        per_name = {"fp32", "fp32_slice", "frozen", "shape", "optimizer_state", "optimizer_state_slice",
                    "param_group_of"}  # fmt: skip
        if attr in per_name:
            return lambda name, *args: getattr(self._reader(name), attr)(name, *args)
        if attr in {"param_groups", "loss_scaler"}:
            return getattr(self.readers[0], attr)
        raise AttributeError(attr)

    def _reader(self, name: str) -> CheckpointReader:
        if name not in self._owner:
            raise KeyError(f"{name!r} is in no stage of the checkpoint")
        return self._owner[name]

    def has_value(self, name: str) -> bool:
        return name in self._owner and self._owner[name].has_value(name)

    @property
    def has_optimizer_state(self) -> bool:
        return all(r.has_optimizer_state for r in self.readers)

    def param_shapes(self) -> dict:
        return {n: r.shape(n) for n, r in self._owner.items()}


def _check_files(path: Path, states: list[dict], with_optimizer: bool) -> None:
    """Every file a load may read is present and whole: each stage's layer files, the ZeRO partitions of every
    (replica, stage) when optimizer state is loaded, and one RNG file per saved rank."""
    saved = states[0]
    stages, replicas = saved["pipeline"]["num_stages"], saved["dp_world_size"]
    if len(states) != stages:
        raise CheckpointError(
            f"checkpoint {path} records {stages} pipeline stages but holds model-states files of {len(states)}"
        )
    needed = [
        layer_file_name(int(index), state["pipeline"]["rank_repr"])
        for state in states
        for index in state["pipeline"]["layer_prefixes"]
    ]
    if with_optimizer and saved["zero_stage"] >= 1:
        needed += [files.zero_optim_states_name(d, s) for s in range(stages) for d in range(replicas)]
    needed += [files.rng_states_name(r) for r in range(stages * replicas)]
    for name in needed:
        problem = files.diagnose(path / name)
        if problem is not None:
            raise CheckpointError(f"checkpoint file {path / name} {problem}")


def _stage_states(path: Path) -> list[dict]:
    states, stage = [], 0
    while (path / files.model_states_name(stage)).is_file():
        states.append(files.load_file(path / files.model_states_name(stage)))
        stage += 1
    if not states:
        raise CheckpointError(f"{path} has no {files.model_states_name(0)}: not a checkpoint")
    if "pipeline" not in states[0]:
        raise CheckpointError(f"{path} was not saved by a pipeline engine (no per-layer files)")
    return states


def _layer_weights(path: Path, state: dict) -> dict[str, torch.Tensor]:
    """A saved stage's parameters and buffers by module name, read from its layer files."""
    meta, weights = state["pipeline"], {}
    for index, prefix in meta["layer_prefixes"].items():
        layer_file = path / layer_file_name(int(index), meta["rank_repr"])
        for key, value in files.load_file(layer_file).items():
            weights[prefix + key] = value
    return weights


def load_pipeline_checkpoint(engine, load_dir, tag, strict, load_optimizer_states, load_scheduler_states,
                             module_only):  # fmt: skip
    found: dict = {}

    def check(path: Path, _model_states: dict) -> None:  # on every rank, before anything is loaded
        found["states"] = _stage_states(path)
        _check_files(path, found["states"], load_optimizer_states and not module_only)

    opened = verify.open_checkpoint(engine, load_dir, tag, check)  # every rank agrees, or all raise
    if opened is None:
        return None, None
    path, states = opened[0], found["states"]
    saved = states[0]["pipeline"]
    same_layout = (
        saved["num_stages"] == engine.num_stages
        and saved["parts"] == list(engine.module.parts)
        and states[0]["dp_world_size"] == engine.world_size
        and states[0]["zero_stage"] == engine.zero_optimization_stage()
    )
    mine = states[engine.stage_id] if engine.stage_id < len(states) else states[0]
    with_optimizer = load_optimizer_states and not module_only and engine.optimizer is not None
    if same_layout:
        _load_own_stage(engine, path, mine, strict, with_optimizer)
    else:
        log_dist(
            f"resharding pipeline checkpoint {path}: saved with {saved['num_stages']} stages x "
            f"{states[0]['dp_world_size']} replicas, loading on {engine.num_stages} x {engine.world_size}",
            ranks=[0],
        )
        _load_by_name(engine, path, states, strict, with_optimizer)
    if module_only:
        return str(path), {}
    _load_progress(engine, mine, load_scheduler_states, realign=not same_layout)
    rng_file = path / files.rng_states_name(dist.get_rank())
    if same_layout and rng_file.is_file():
        _set_rng_state(files.load_file(rng_file))
    client_state = {k: v for k, v in mine.items() if k not in ENGINE_KEYS and k != "pipeline"}
    dist.barrier()
    return str(path), client_state


def _load_own_stage(engine, path: Path, state: dict, strict: bool, with_optimizer: bool) -> None:
    weights = _layer_weights(path, state)
    try:
        engine.module.load_state_dict(weights, strict=strict)
    except RuntimeError as err:
        raise CheckpointError(
            f"checkpoint {path} does not match stage {engine.stage_id}'s layers: {err}"
        ) from err
    optimizer = engine.optimizer
    if optimizer is None:
        return
    if not with_optimizer:
        optimizer.refresh_masters_from_module()
        return
    if optimizer.zero_stage == 0:
        saved = state["optimizer"]
    else:
        saved = files.load_file(path / files.zero_optim_states_name(engine.dp_rank, engine.stage_id))
        saved = saved["optimizer_state_dict"]
    optimizer.load_state_dict(saved)


def _load_by_name(engine, path: Path, states: list[dict], strict: bool, with_optimizer: bool) -> None:
    readers = []
    for stage, state in enumerate(states):
        state = dict(state, module=_layer_weights(path, state))
        readers.append(_StageReader(path, state, stage))
    reader = _PipelineReader(readers)
    missing = [n for n, _ in engine.module.named_parameters() if not reader.has_value(n)]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no value for parameters {missing[:6]}")
    restored: set[str] = set()
    with torch.no_grad():
        if engine.optimizer is not None:
            restored = engine.optimizer.load_universal(reader, with_optimizer)
        for name, param in engine.module.named_parameters():
            if name not in restored:
                param.data.copy_(reader.fp32(name))
    buffers = {}
    for r in readers:
        buffers.update({n: r.buffer(n).clone() for n in r.buffer_names()})
    own = dict(engine.module.named_buffers())
    engine.module.load_state_dict({k: v for k, v in buffers.items() if k in own}, strict=False)
    if strict and set(own) - set(buffers):
        raise CheckpointError(f"checkpoint {path} lacks buffers {sorted(set(own) - set(buffers))[:6]}")
