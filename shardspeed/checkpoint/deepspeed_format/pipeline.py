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
its files. At ZeRO stage 1 `param_shapes` names the stage's parameters. At ZeRO stage 0 it is None, and:

- in bf16, DeepSpeed's `BF16_Optimizer` writes `bf16_zero_pp_rank_D_mp_rank_SS_optim_states.pt` (ZeRO-1's flat
  layout, read.py), whose `param_slice_mappings` name every parameter of the stage with its place in rank D's
  slice: the stage's `param_shapes` are rebuilt from them (each parameter in the order of its place, its shape
  from its layer file), and read.py checks every place against the layout those shapes give;
- in fp32, `optimizer` is the torch optimizer's state dict of the stage, with no names: its index k is matched
  by order (`_zero0_stage_params`). The rule: each stage's optimizer holds its stage's parameters in module
  order (as `module.parameters()` gives them: layers by global index, each layer's in its state-dict order),
  and the stages hold consecutive layers; so the parameters of every layer file, in that order, cut into runs
  of each stage's parameter count, are the stages' parameters. Checked, refused naming the file otherwise:
  the counts add up to the layer files' parameters, no layer is cut between two stages, each stage's buffers
  are in its layers, and every optimizer state tensor has its parameter's shape (read.py).

`stage_states` returns each stage's model-states dict with its `module` rebuilt from the layer files, so that
`DeepSpeedCheckpointReader(tag_dir, model_states=..., mp_rank=SS)` reads that stage by parameter name. What
this version does not read (tied layers; tensor parallelism inside the pipeline; a ZeRO-0 stage saved without
optimizer state, whose layers nothing names) is refused naming the file.
"""

from __future__ import annotations

from pathlib import Path

from shardspeed.checkpoint.deepspeed_format.read import is_bf16_optimizer_state
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


def _bf16_optimizer_file(tag_dir: Path, rank: int, stage: int) -> Path:
    return Path(tag_dir) / f"bf16_zero_pp_rank_{rank}_mp_rank_{stage:02d}_optim_states.pt"


def _stage_param_names(tag_dir: Path, raw: dict, stage: int, read_file) -> list[list[str]]:
    """The parameter names of stage `stage`, per optimizer group in flat order (see the module's docstring)."""
    shapes = raw.get("param_shapes")
    if isinstance(shapes, list):
        return [list(group) for group in shapes]
    if is_bf16_optimizer_state(raw.get("optimizer")):
        return _bf16_optimizer_names(tag_dir, raw, stage, read_file)
    return [_zero0_stage_params(tag_dir, read_file)[stage]]


def _bf16_optimizer_names(tag_dir: Path, raw: dict, stage: int, read_file) -> list[list[str]]:
    """BF16_Optimizer: every data-parallel rank's `param_slice_mappings` name the parameters of its slice."""
    groups: list[list[str]] = []
    for rank in range(int(raw.get("dp_world_size") or 1)):
        path = _bf16_optimizer_file(tag_dir, rank, stage)
        if not path.is_file():
            raise CheckpointError(
                f"DeepSpeed pipeline checkpoint {tag_dir} is incomplete: {path.name} is missing"
            )
        mappings = (read_file(path, mmap=True).get("optimizer_state_dict") or {}).get("param_slice_mappings")
        if not isinstance(mappings, list):
            raise CheckpointError(f"{path} has no param_slice_mappings: the stage's parameters are not named")
        groups += [[] for _ in range(len(mappings) - len(groups))]
        for group, mapping in zip(groups, mappings):
            ordered = sorted(mapping.items(), key=lambda item: item[1]["start"])
            group += [name for name, _ in ordered if name not in group]
    return groups


def _layer_files(tag_dir: Path) -> list[int]:
    indices = []
    for path in Path(tag_dir).glob("layer_*-model_states.pt"):
        head = path.name[len("layer_") :].split("-", 1)[0]
        if head.isdigit():
            indices.append(int(head))
    return sorted(indices)


def _zero0_stage_params(tag_dir: Path, read_file) -> list[list[str]]:
    """fp32 at ZeRO stage 0: each stage's parameter names, by the order rule of the module's docstring."""
    tag_dir = Path(tag_dir)
    first_path = _stage_path(tag_dir, 0)
    stages = int(
        (read_file(first_path, mmap=True).get("checkpoint_parallel_dimensions") or {}).get("pp_degree") or 1
    )
    counts, buffers, buffers_of = [], set(), []
    for stage in range(stages):
        path = _stage_path(tag_dir, stage)
        if not path.is_file():
            raise CheckpointError(
                f"DeepSpeed pipeline checkpoint {tag_dir} is incomplete: {path.name} is missing"
            )
        raw = read_file(path, mmap=True)
        optimizer = raw.get("optimizer")
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("param_groups"), list):
            raise CheckpointError(
                f"{path} is a DeepSpeed pipeline stage that records neither parameter names ('param_shapes', "
                "None at ZeRO stage 0) nor optimizer state: nothing says which layers it held, so this version "
                "does not read it"
            )
        counts.append(sum(len(group["params"]) for group in optimizer["param_groups"]))
        buffers_of.append(set(raw.get("buffer_names") or []))
        buffers |= buffers_of[-1]
    params: list[tuple[int, str]] = []  # (layer, name) of every layer file's parameters, in module order
    for index in _layer_files(tag_dir):
        content = read_file(layer_file(tag_dir, index), mmap=True)
        params += [(index, f"{index}.{key}") for key in content if f"{index}.{key}" not in buffers]
    if sum(counts) != len(params):
        raise CheckpointError(
            f"{first_path}: the stages' optimizers hold {counts} parameters ({sum(counts)}), the layer files "
            f"{len(params)}: DeepSpeed records no names at ZeRO stage 0, and with counts that differ (frozen "
            "parameters, or an optimizer given other parameters) they cannot be matched by order"
        )
    out, start = [], 0
    for stage, count in enumerate(counts):
        run = params[start : start + count]
        start += count
        cut = [p for p in (start - count, start) if 0 < p < len(params) and params[p - 1][0] == params[p][0]]
        if cut:
            raise CheckpointError(
                f"{_stage_path(tag_dir, stage)}: by parameter count, stage {stage} would end or start inside layer "
                f"{params[cut[0]][0]}; the parameters cannot be matched to the stages by order"
            )
        out.append([name for _, name in run])
    _check_buffers_within(tag_dir, out, buffers_of)
    return out


def _check_buffers_within(tag_dir: Path, stage_params: list[list[str]], buffers_of: list[set]) -> None:
    """Each stage's buffers lie between the first and last layers its parameters give, or beside them where
    no other stage's parameters are (a stage's layers are consecutive)."""
    spans = []
    for names in stage_params:
        layers = [int(n.split(".", 1)[0]) for n in names]
        spans.append((min(layers), max(layers)) if layers else None)
    for stage, buffers in enumerate(buffers_of):
        for name in buffers:
            layer = int(name.split(".", 1)[0]) if name.split(".", 1)[0].isdigit() else -1
            owners = [s for s, span in enumerate(spans) if span and span[0] <= layer <= span[1]]
            if owners and owners != [stage]:
                raise CheckpointError(
                    f"{_stage_path(tag_dir, stage)} lists buffer {name!r}, whose layer holds stage {owners[0]}'s "
                    "parameters by the order rule: the parameters cannot be matched to the stages by order"
                )


def _layer_indices(path: Path, raw: dict, names: list[str]) -> list[int]:
    """The global layer indices of one stage, from its parameter and buffer names."""
    names = list(names) + list(raw.get("buffer_names") or [])
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
    groups = _stage_param_names(tag_dir, raw, stage, read_file)
    module = {}
    for index in _layer_indices(path, raw, [n for group in groups for n in group]):
        source = layer_file(tag_dir, index)
        if not source.is_file():
            raise CheckpointError(
                f"DeepSpeed pipeline checkpoint {tag_dir} is incomplete: {path.name} names layer {index}'s "
                f"parameters, but {source.name} is missing"
            )
        module.update({f"{index}.{key}": value for key, value in read_file(source).items()})
    out = dict(raw, module=module)
    if not isinstance(raw.get("param_shapes"), list) and is_bf16_optimizer_state(raw.get("optimizer")):
        missing = [n for group in groups for n in group if n not in module]
        if missing:
            raise CheckpointError(
                f"{path}: its param_slice_mappings name {missing[:4]}, which no layer file holds"
            )
        out["param_shapes"] = [{n: tuple(module[n].shape) for n in group} for group in groups]
    return out


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
