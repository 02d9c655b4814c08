"""Write a checkpoint in DeepSpeed 0.19.8's layout, from any checkpoint this library reads (by name).

    shardspeed-to-deepspeed <checkpoint_dir> <output_dir> [-t TAG] [--world-size N] [--zero-stage S]
    python -m shardspeed.checkpoint.deepspeed_format.write ...          # the same

The output folder is what DeepSpeed's `engine.save_checkpoint` would have written at `--world-size` data-parallel
ranks and ZeRO stage `--zero-stage` (both default to the source's): `latest`, and in `<output_dir>/<tag>/` the
model-states file(s) and per-rank ZeRO files of layout.py. DeepSpeed 0.19.8's `load_checkpoint` resumes from
it at that world size and stage, and the `zero_to_fp32.py` DeepSpeed ships consolidates it. Every value comes
from the source reader (`open_checkpoint`): the fp32 masters, the optimizer state element for element, the
group hyper-parameters, the counters, the LR scheduler, the data sampler and the client's entries.

Plain types are pickled, and the two objects DeepSpeed's loaders need as objects, under DeepSpeed's names:
a static loss scaler of scale 1 (fp32 and bf16 runs have no scale to carry) and the ZeRO stage
(pickled.py; nothing of DeepSpeed is imported). Not written: DeepSpeed's `param_slice_mappings`
(only its universal-checkpoint conversion reads them), an fp16 loss scale and tensor-parallel files (such
checkpoints are refused by name). A checkpoint of a model with MoE layers is written in DeepSpeed's MoE layout by
write_moe.py.

A pipeline checkpoint (shardspeed's PipelineEngine's) is written stage by stage (`_pipeline_contents`), as
DeepSpeed's PipelineEngine saves one at ZeRO stage 0 or 1: the layer files as they are, and for each stage SS
its `mp_rank_SS_model_states.pt` (`module` None, the stage's `param_shapes`, `mp_world_size` and
`checkpoint_parallel_dimensions.pp_degree` = the stage count; at ZeRO-0 the stage's torch optimizer state,
indexed in the stage's parameter order) and its `zero_pp_rank_D_mp_rank_SS_optim_states.pt` at ZeRO-1. The
stage count and partition are the saved ones (DeepSpeed's PipelineModule must be built with the same); the
data-parallel size may change. Refused by name: bf16 at ZeRO-0 (DeepSpeed runs its BF16_Optimizer there, whose
files are not written), ZeRO stages 2-3 (DeepSpeed's pipelines do not run them), tied layers.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
from pathlib import Path

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format import pickled
from shardspeed.checkpoint.deepspeed_format.engine_view import read_model_states
from shardspeed.checkpoint.deepspeed_format.layout import Zero3Layout, Zero12Layout
from shardspeed.checkpoint.deepspeed_format.pipeline_source import layer_file_names, stage_sources
from shardspeed.checkpoint.deepspeed_format.read import model_states_path, read_file
from shardspeed.checkpoint.deepspeed_format.write_moe import MoESource, moe_files
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.readers import open_checkpoint
from shardspeed.checkpoint.universal import resolve_tag_dir

__all__ = ["DEEPSPEED_VERSION", "main", "write_deepspeed_checkpoint"]

DEEPSPEED_VERSION = "0.19.8"  # the version whose layout is written (and recorded, as DeepSpeed checks it)

# Entries of a shardspeed model-states file that are not the client's (checkpoint/parts.py's parts).
_OURS = {
    "module", "buffer_names", "param_shapes", "frozen_param_names", "shared_params", "optimizer", "zero_stage",
    "zero_partitions", "dp_world_size", "mp_world_size", "mp_rank", "tp_partitions", "lr_scheduler",
    "compression_scheduler", "data_sampler", "global_steps", "global_samples", "skipped_steps", "micro_steps",
    "ds_config", "ds_version", "shardspeed_version", "num_experts", "moe_layout", "ds_autoep_layers", "random_ltd",
    "curriculum_scheduler_legacy",
}  # fmt: skip
# (shardspeed's MoE checkpoints are written by write_moe.py, its pipeline checkpoints by `_pipeline_contents`;
# DeepSpeed's own are not rewritten)
_NOT_WRITTEN = {
    "num_experts": "DeepSpeed MoE",
    "tp_partitions": "tensor-parallel",
}


def _dtype(ds_config: dict) -> torch.dtype:
    if (ds_config.get("bf16") or {}).get("enabled") is True:
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled") is True:
        return torch.float16
    return torch.float32


class _Source:
    """What the writer needs from the source checkpoint, by name."""

    def __init__(self, checkpoint_dir, tag, stage_source=None):
        """`stage_source`: one pipeline stage's (reader, entries) from pipeline_source.py instead."""
        if stage_source is not None:
            self.reader, self.entries = stage_source
        else:
            self.reader = open_checkpoint(checkpoint_dir, tag)
            self.entries = read_model_states(self.reader.path)
        for key, what in _NOT_WRITTEN.items():
            if self.entries.get(key):
                raise CheckpointError(
                    f"{self.reader.path} is a {what} checkpoint ({key!r}): its DeepSpeed layout is not written"
                )
        self.ds_config = dict(self.entries.get("ds_config") or {})
        self.dtype = _dtype(self.ds_config)
        frozen = set(self.reader.frozen_param_names())
        self.trainable = [n for n in self.reader.param_names() if n not in frozen]
        self.frozen = [n for n in self.reader.param_names() if n in frozen]
        groups = self.reader.param_groups()
        if not groups:
            raise CheckpointError(
                f"{self.reader.path} holds no optimizer state: nothing for DeepSpeed to resume"
            )
        self.groups: list[list[str]] = [[] for _ in groups]
        for name in self.trainable:
            gi = self.reader.param_group_of(name)
            self.groups[0 if gi is None else gi].append(name)
        self.hyper = groups

    def shapes(self, names) -> dict:
        return {n: torch.Size(self.reader.shape(n)) for n in names}

    def scalars(self, name: str) -> dict:
        return self.reader.optimizer_state_slice(name, 0, 0)[1]


def _flat(source: _Source, names, pieces_of, key: str | None, size: int) -> torch.Tensor:
    """One rank's flat buffer of `size` elements: each name's (lo, hi, at) pieces, fp32 or state `key`."""
    out = torch.zeros(size, dtype=torch.float32)
    for name in names:
        for lo, hi, at in pieces_of(name):
            if key is None:
                value = source.reader.fp32_slice(name, lo, hi)
            else:
                value = source.reader.optimizer_state_slice(name, lo, hi)[0].get(key)
                if value is None:
                    continue
            out[at : at + hi - lo] = value
    return out


def _state_keys(source: _Source, names) -> list[str]:
    return list(source.reader.optimizer_state_slice(names[0], 0, 1)[0]) if names else []


def _optimizer_state(source: _Source, buffers, pieces_of, sizes) -> dict:
    """torch's optimizer state dict over one flat parameter per buffer (DeepSpeed's base optimizer)."""
    state = {}
    for b, names in enumerate(buffers):
        if not names:
            continue
        entry = {k: _flat(source, names, pieces_of, k, sizes[b]) for k in _state_keys(source, names)}
        entry.update({k: v for k, v in source.scalars(names[0]).items()})
        state[b] = entry
    groups = [{**hyper, "params": [b]} for b, hyper in enumerate(source.hyper)]
    return {"state": state, "param_groups": groups}


def _zero12_files(source: _Source, world: int, stage: int) -> list[dict]:
    layout = Zero12Layout([list(source.shapes(g).items()) for g in source.groups], [], world)
    out = []
    for rank in range(world):
        pieces_of = functools.partial(layout.held_by, rank=rank)
        sizes = layout.partition_numel
        fp32 = [
            _flat(source, names, pieces_of, None, sizes[g])[: layout.expected_fp32_numel(rank, g)]
            for g, names in enumerate(source.groups)
        ]
        paddings = [sizes[g] - f.numel() for g, f in enumerate(fp32)]
        osd = {
            "loss_scaler": pickled.loss_scaler(), "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": float(source.ds_config.get("gradient_clipping", 1.0)),
            "base_optimizer_state": _optimizer_state(source, source.groups, pieces_of, sizes),
            "single_partition_of_fp32_groups": fp32, "zero_stage": pickled.zero_stage(stage),
            "group_paddings": paddings, "param_alignment_paddings": [[0] * len(g) for g in source.groups],
            "partition_count": [world] * len(source.groups), "ds_version": DEEPSPEED_VERSION,
        }  # fmt: skip
        out.append(osd)
    return out


def _zero3_files(source: _Source, world: int) -> list[dict]:
    layout = Zero3Layout([list(source.shapes(g).items()) for g in source.groups], world)
    out = []
    for rank in range(world):
        pieces_of = functools.partial(layout.held_by, rank=rank)
        sizes = layout.buffer_numel
        osd = {
            "zero_stage": pickled.zero_stage(3), "loss_scaler": pickled.loss_scaler(),
            "dynamic_loss_scale": False, "overflow": False, "partition_count": world,
            "optimizer_state_dict": _optimizer_state(source, source.groups, pieces_of, sizes),
            "fp32_flat_groups": [_flat(source, names, pieces_of, None, sizes[s])
                                 for s, names in enumerate(source.groups)],
        }  # fmt: skip
        out.append(osd)
    return out


def _stage0_optimizer(source: _Source) -> dict:
    state, groups, index = {}, [], 0
    for g, names in enumerate(source.groups):
        params = []
        for name in names:
            saved = source.reader.optimizer_state(name)
            if saved:
                state[index] = saved
            params.append(index)
            index += 1
        groups.append({**source.hyper[g], "params": params})
    inner = {"state": state, "param_groups": groups}
    if source.dtype == torch.float32:
        return inner
    steps = int(source.entries.get("global_steps") or 0)
    masters = [[source.reader.fp32(n).clone() for n in names] for names in source.groups]
    return {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": steps, "optimizer_state_dict": inner,
            "fp32_groups": masters}  # fmt: skip


def _model_states(source: _Source, world: int, stage: int, rank: int) -> dict:
    reader, entries = source.reader, source.entries
    module = {}
    for key in reader.state_dict_keys():
        name = reader.shared_params().get(key, key)
        if key in reader.buffer_names():
            module[key] = reader.buffer(key).clone()
        elif stage == 3:
            module[key] = torch.empty(0, dtype=source.dtype)
        else:
            module[key] = reader.fp32(name).to(source.dtype)
    frozen = None
    if stage >= 2:
        frozen = {n: reader.fp32(n).to(source.dtype) for n in source.frozen}
        if stage == 3:
            for n, value in frozen.items():
                c = -(-value.numel() // world)
                piece = torch.zeros(c, dtype=value.dtype)
                part = value.reshape(-1)[rank * c : (rank + 1) * c]
                piece[: part.numel()] = part
                frozen[n] = piece
    return {
        "module": module,
        "buffer_names": reader.buffer_names(),
        "optimizer": _stage0_optimizer(source) if stage == 0 else None,
        "param_shapes": None if stage == 0 else [source.shapes(g) for g in source.groups],
        "frozen_param_shapes": source.shapes(source.frozen) if stage >= 2 else None,
        "frozen_param_fragments": frozen,
        "shared_params": reader.shared_params() if stage > 0 else None,
        **_common_entries(entries, source.ds_config, world),
    }


def _common_entries(entries: dict, ds_config: dict, world: int) -> dict:
    """The model-states entries every DeepSpeed layout shares: scheduler, sampler, counters, config, the
    client's entries (every entry of ours that is no part's)."""
    client = {k: v for k, v in entries.items() if k not in _OURS}
    return {
        "lr_scheduler": entries.get("lr_scheduler"),
        "data_sampler": entries.get("data_sampler"),
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": int(entries.get("skipped_steps") or 0),
        "global_steps": int(entries.get("global_steps") or 0),
        "global_samples": int(entries.get("global_samples") or 0),
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_config": ds_config,
        "ds_version": DEEPSPEED_VERSION,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        **client,
    }


def _moe_contents(path: Path, entries: dict, world_size, zero_stage) -> tuple[str, dict]:
    """Our checkpoint of a model with MoE layers: (tag, {file name: content}) in DeepSpeed's MoE layout."""
    source = MoESource(path, entries)
    world = int(world_size or source.world)
    stage = source.zero_stage if zero_stage is None else int(zero_stage)
    ds_config = dict(entries.get("ds_config") or {})
    ds_config["zero_optimization"] = {**(ds_config.get("zero_optimization") or {}), "stage": stage}
    model_states = {"module": dict(entries["module"]), "buffer_names": list(entries.get("buffer_names") or []),
                    **_common_entries(entries, ds_config, world)}  # fmt: skip
    return path.name, moe_files(source, model_states, world, stage, DEEPSPEED_VERSION)


def write_deepspeed_checkpoint(
    checkpoint_dir, output_dir, tag=None, *, world_size=None, zero_stage=None
) -> Path:
    """Write the checkpoint in `checkpoint_dir` (ours or DeepSpeed's; `tag` or `latest`) into `output_dir`
    in DeepSpeed 0.19.8's layout at `world_size` ranks and ZeRO stage `zero_stage` (default: the source's).
    Returns the tag folder written. The folder is staged and renamed into place, `latest` written last."""
    root = Path(checkpoint_dir)
    path = root if tag is None and model_states_path(root).is_file() else resolve_tag_dir(root, tag)
    entries = read_model_states(path)
    if "moe_layout" in entries:  # ours, with MoE layers (DeepSpeed's own MoE checkpoints are refused below)
        name, contents = _moe_contents(path, entries, world_size, zero_stage)
        return _write(Path(output_dir), name, contents)
    if entries.get("pipeline"):  # ours, from a PipelineEngine
        return _write(Path(output_dir), path.name, _pipeline_contents(path, world_size, zero_stage))
    if getattr(entries, "pipeline_stages", 1) > 1:
        raise CheckpointError(
            f"{path} is a DeepSpeed pipeline checkpoint ({entries.pipeline_stages} stages): it is in DeepSpeed's "
            "layout already; rewriting it at another data-parallel size is not offered by this version"
        )
    source = _Source(checkpoint_dir, tag)
    world = int(world_size or source.reader.world_size)
    stage = source.reader.zero_stage if zero_stage is None else int(zero_stage)
    if stage not in (0, 1, 2, 3) or world < 1:
        raise ValueError(f"zero_stage must be 0-3 and world_size >= 1, got {zero_stage!r} and {world_size!r}")
    source.ds_config.setdefault("zero_optimization", {})
    source.ds_config["zero_optimization"] = {**source.ds_config["zero_optimization"], "stage": stage}
    contents = {}
    if stage == 3:
        for rank in range(world):
            contents[f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] = _model_states(
                source, world, stage, rank
            )
    else:
        contents[files.model_states_name()] = _model_states(source, world, stage, 0)
    partitions = (
        []
        if stage == 0
        else _zero3_files(source, world)
        if stage == 3
        else _zero12_files(source, world, stage)
    )
    prefix = "bf16_" if source.dtype == torch.bfloat16 else ""
    for rank, osd in enumerate(partitions):
        outer = {"optimizer_state_dict": osd, "ds_config": source.ds_config, "ds_version": DEEPSPEED_VERSION}
        contents[f"{prefix}{files.zero_optim_states_name(rank)}"] = outer
    return _write(Path(output_dir), source.reader.path.name, contents)


def _write(out: Path, name: str, contents: dict) -> Path:
    """Write `contents` ({file name: object}) as tag folder `out/name`: staged, renamed into place, then
    `latest`; what was written is read back weights-only."""
    staging = files.staging_dir(out, name)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for file_name, content in contents.items():
        files.save_file(content, staging / file_name, pickled.PICKLE_MODULE)
    final = out / name
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    files.fsync_dir(out)
    files.atomic_write_text(out / files.LATEST, name)
    read_file(model_states_path(final))  # what was written reads back weights-only
    return final


def _pipeline_contents(tag_dir: Path, world_size, zero_stage) -> dict:
    """A shardspeed pipeline checkpoint's files in DeepSpeed's pipeline layout (the module's docstring)."""
    sources = [_Source(None, None, stage_source=s) for s in stage_sources(tag_dir)]
    first = sources[0]
    world = int(world_size or first.reader.world_size)
    stage = first.reader.zero_stage if zero_stage is None else int(zero_stage)
    if stage not in (0, 1) or world < 1:
        raise CheckpointError(
            f"{tag_dir} is a pipeline checkpoint: DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1 and world size "
            f">= 1 data-parallel ranks, not stage {stage!r} at {world!r}"
        )
    if stage == 0 and first.dtype == torch.bfloat16:
        raise CheckpointError(
            f"{tag_dir}: a bf16 pipeline at ZeRO stage 0 runs DeepSpeed's BF16_Optimizer, whose files this version "
            "does not write (write it at --zero-stage 1)"
        )
    contents = {}
    for mp_rank, source in enumerate(sources):
        source.ds_config["zero_optimization"] = {
            **(source.ds_config.get("zero_optimization") or {}),
            "stage": stage,
        }
        model = _model_states(source, world, stage, 0)
        model.pop("pipeline", None)
        model.update(module=None, mp_world_size=len(sources), shared_params=None if stage == 0 else {},
                     checkpoint_parallel_dimensions={"pp_degree": len(sources), "tp_degree": 1})  # fmt: skip
        contents[files.model_states_name(mp_rank)] = model
        for name in layer_file_names(tag_dir, source.entries):
            contents[name] = files.load_file(tag_dir / name)
        prefix = "bf16_" if source.dtype == torch.bfloat16 else ""
        for rank, osd in enumerate(_zero12_files(source, world, stage) if stage == 1 else []):
            outer = {
                "optimizer_state_dict": osd,
                "ds_config": source.ds_config,
                "ds_version": DEEPSPEED_VERSION,
            }
            contents[f"{prefix}{files.zero_optim_states_name(rank, mp_rank)}"] = outer
    return contents


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="shardspeed-to-deepspeed",
        description="Write a checkpoint (shardspeed's or DeepSpeed's) in DeepSpeed 0.19.8's layout.",
    )
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest', or a tag folder")
    parser.add_argument("output_dir", help="where to write: <output_dir>/latest and <output_dir>/<tag>/")
    parser.add_argument("-t", "--tag", default=None, help="the tag to convert (default: the one in 'latest')")
    parser.add_argument("--world-size", type=int, default=None, help="DeepSpeed's data-parallel world size")
    parser.add_argument(
        "--zero-stage", type=int, default=None, choices=[0, 1, 2, 3], help="DeepSpeed's stage"
    )
    args = parser.parse_args(argv)
    path = write_deepspeed_checkpoint(
        args.checkpoint_dir, args.output_dir, args.tag, world_size=args.world_size, zero_stage=args.zero_stage
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
