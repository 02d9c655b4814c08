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

DeepSpeed's own pipeline checkpoints (layer files without a `pipeline` entry; ZeRO stage 1, no tied layers)
are read through checkpoint/deepspeed_format/pipeline.py: one `DeepSpeedCheckpointReader` per saved stage,
always by parameter name, since DeepSpeed records no partition bounds. They load at any number of stages and
replicas here; DeepSpeed itself needs the same layout. DeepSpeed saves no RNG streams for them.

`PipelineLayers` is the checkpoint part (checkpoint/parts.py) that does this: the pipeline engine's
`ModelStates`, placed at its stage (`mp_rank` = stage), with the weights in the layer files. The rest of the
save and load is the engine's own (checkpoint/engine_io.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointReader, deepspeed_raw
from shardspeed.checkpoint.deepspeed_format.pipeline import stage_states
from shardspeed.checkpoint.deepspeed_format.read import read_file
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.model_states import ModelStates
from shardspeed.checkpoint.parts import LoadContext, LoadOptions, SaveOptions
from shardspeed.checkpoint.universal import CheckpointReader
from shardspeed.utils.logging import log_dist

__all__ = ["PipelineLayers", "layer_file_name"]


def layer_file_name(index: int, rank_repr: str = "") -> str:
    return f"layer_{index:02d}{'-' + rank_repr if rank_repr else ''}-model_states.pt"


def _layer_prefixes(module) -> dict[int, str]:
    """Global layer index -> the prefix of its parameters in the module ("3." or "tied_modules.embed.")."""
    prefixes = {}
    for index, layer in module.local_layers():
        key = next((k for k, m in module.tied_modules.items() if m is layer), None)
        prefixes[index] = f"tied_modules.{key}." if key is not None else f"{index}."
    return prefixes


class PipelineLayers(ModelStates):
    """This stage's layers and optimizer wrapper: `module` is None in the model-states file (as DeepSpeed:
    the weights are in the layer files), which also records the stage's `pipeline` layout. `num_stages` and
    `stage` are the engine's; `placement.mp_rank` is the stage."""

    keys = (*ModelStates.keys, "pipeline")
    reads_universal = False  # pipeline stages are not mapped onto the universal layout yet

    def __init__(self, *args, num_stages: int, stage: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_stages = num_stages
        self.stage = stage
        self._found: list[dict] = []  # every stage's model-states, read by `check`
        self._readers: list = []  # a DeepSpeed checkpoint: one by-name reader per saved stage, by `check`

    def _rank_repr(self) -> str:
        return self.module.topology().get_rank_repr(dist.get_rank())

    def state_dict(self, options: SaveOptions) -> dict:
        state = super().state_dict(options)
        state["module"] = None  # as DeepSpeed: the weights live in the layer files
        state["pipeline"] = {
            "num_stages": self.num_stages,
            "stage": self.stage,
            "parts": list(self.module.parts),
            "layer_prefixes": _layer_prefixes(self.module),
            "rank_repr": self._rank_repr(),
        }
        return state

    def write_files(self, staging: Path, options: SaveOptions) -> None:
        """The stage's layer files (data-parallel rank 0) and this rank's ZeRO partition."""
        if self.placement.dp_rank == 0:
            rank_repr = self._rank_repr()
            for index, layer in self.module.local_layers():
                files.save_file(layer.state_dict(), staging / layer_file_name(index, rank_repr))
        if self.optimizer is not None and self.optimizer.zero_stage > 0:
            partition = {"optimizer_state_dict": self.optimizer.state_dict(), "ds_config": self.ds_config}
            files.save_file(partition, staging / self.partition_name())

    def check(self, path: Path, state: dict, options: LoadOptions) -> None:  # every rank, before loading
        if deepspeed_raw(state) is not None:
            self._readers = _deepspeed_stage_readers(path, options.optimizer)
            return
        self._readers = []
        self._found = _stage_states(path)
        _check_files(path, self._found, options.optimizer)

    def load_state_dict(self, entries: dict, ctx: LoadContext) -> None:
        if self._readers:  # DeepSpeed's layer files: assembled by name, whatever the layout
            first = self._readers[0]
            log_dist(
                f"loading DeepSpeed pipeline checkpoint {ctx.path}: saved with {len(self._readers)} stages x "
                f"{first.world_size} replicas, loading on {self.num_stages} x {self.placement.dp_world_size}",
                ranks=[0],
            )
            with_optimizer = ctx.options.optimizer and self.optimizer is not None
            self._load_by_name(ctx.path, self._readers, ctx.options.strict, with_optimizer)
            ctx.resharded = (len(self._readers), first.world_size) != (
                self.num_stages,
                self.placement.dp_world_size,
            )
            return
        path, states = ctx.path, self._found
        saved = states[0]["pipeline"]
        same_layout = (
            saved["num_stages"] == self.num_stages
            and saved["parts"] == list(self.module.parts)
            and states[0]["dp_world_size"] == self.placement.dp_world_size
            and states[0]["zero_stage"] == self.zero_stage
        )
        # the parts after this one read this stage's file (the first stage's at another stage count)
        ctx.state = states[self.stage] if self.stage < len(states) else states[0]
        with_optimizer = ctx.options.optimizer and self.optimizer is not None
        if same_layout:
            self._load_own_stage(path, ctx.state, ctx.options.strict, with_optimizer)
        else:
            log_dist(
                f"resharding pipeline checkpoint {path}: saved with {saved['num_stages']} stages x "
                f"{states[0]['dp_world_size']} replicas, loading on {self.num_stages} x "
                f"{self.placement.dp_world_size}",
                ranks=[0],
            )
            readers = [
                _StageReader(path, dict(state, module=_layer_weights(path, state)), stage)
                for stage, state in enumerate(states)
            ]
            self._load_by_name(path, readers, ctx.options.strict, with_optimizer)
        ctx.resharded = not same_layout

    def _load_own_stage(self, path: Path, state: dict, strict: bool, with_optimizer: bool) -> None:
        weights = _layer_weights(path, state)
        try:
            self.module.load_state_dict(weights, strict=strict)
        except RuntimeError as err:
            raise CheckpointError(
                f"checkpoint {path} does not match stage {self.stage}'s layers: {err}"
            ) from err
        optimizer = self.optimizer
        if optimizer is None:
            return
        if not with_optimizer:
            optimizer.refresh_masters_from_module()
            return
        if optimizer.zero_stage == 0:
            saved = state["optimizer"]
        else:
            saved = files.load_file(path / self.partition_name())["optimizer_state_dict"]
        optimizer.load_state_dict(saved)

    def _load_by_name(self, path: Path, readers: list, strict: bool, with_optimizer: bool) -> None:
        """Load from `readers`, one by-name reader per saved stage."""
        reader = _PipelineReader(readers)
        module = self.module
        missing = [n for n, _ in module.named_parameters() if not reader.has_value(n)]
        if missing:
            raise CheckpointError(f"checkpoint {path} has no value for parameters {missing[:6]}")
        restored: set[str] = set()
        with torch.no_grad():
            if self.optimizer is not None:
                restored = self.optimizer.load_universal(reader, with_optimizer)
            for name, param in module.named_parameters():
                if name not in restored:
                    param.data.copy_(reader.fp32(name))
        buffers = {}
        for r in readers:
            buffers.update({n: r.buffer(n).clone() for n in r.buffer_names()})
        own = dict(module.named_buffers())
        module.load_state_dict({k: v for k, v in buffers.items() if k in own}, strict=False)
        if strict and set(own) - set(buffers):
            raise CheckpointError(f"checkpoint {path} lacks buffers {sorted(set(own) - set(buffers))[:6]}")


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


def _deepspeed_stage_readers(path: Path, with_optimizer: bool) -> list[DeepSpeedCheckpointReader]:
    """A by-name reader of each stage of a DeepSpeed pipeline checkpoint (deepspeed_format/pipeline.py), every
    file a load reads checked first: the layer files, and each stage's ZeRO partitions."""
    readers = []
    for stage, raw in enumerate(stage_states(path, read_file)):
        reader = DeepSpeedCheckpointReader(path, model_states=raw, mp_rank=stage)
        if with_optimizer and reader.has_partition_files:
            for rank in range(reader.world_size):
                reader.check_rank_file(rank)
        readers.append(reader)
    return readers


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
