"""`ds_to_universal`: write DeepSpeed's universal checkpoint layout (checkpoint/universal_folder.py) from a
checkpoint, with DeepSpeed's command line.

    shardspeed-ds-to-universal --input_folder CKPT/global_step6 --output_folder CKPT/global_step6_universal \
        [--inject_missing_state] [--num_extract_workers 4] [--num_merge_workers 2] [--no_strict]
    python -m shardspeed.checkpoint.to_universal ...      (the same)

`--input_folder` is one checkpoint's tag folder; `--output_folder` gets the universal folder and its parent
`latest_universal`, as DeepSpeed's tool does. DeepSpeed 0.19.8 loads the result with
`"checkpoint": {"load_universal": true}` at ZeRO stages 1-3, and shardspeed at any stage and world size.

How it differs from DeepSpeed's tool: every parameter is assembled by name from the partition files
(`CheckpointReader`), in memory, so there are no intermediate fragment files — `--keep_temp_folder`, which
keeps them in DeepSpeed, is refused. Extraction (reading each parameter's pieces) runs on
`--num_extract_workers` threads, writing on `--num_merge_workers` threads; at most `--num_extract_workers`
parameters are held in memory at once. The folder is written under a hidden staging name and renamed into
place when complete, so an interrupted conversion leaves no half-written universal folder. With the default
`--strict`, the written folder is read back and checked against the source (names, shapes, state files).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint import universal_folder as layout
from shardspeed.checkpoint.deepspeed_format import zero3_tp
from shardspeed.checkpoint.deepspeed_format.autotp import DeepSpeedAutoTPReader
from shardspeed.checkpoint.deepspeed_format.read import is_deepspeed_state
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.version import __version__

__all__ = ["command", "main", "parse_arguments", "validate_autotp_conversion_support", "write_universal"]

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
UNIVERSAL_CHECKPOINT_VERSION = {"universal_checkpoint_version": 0.4}  # what DeepSpeed 0.19.8's tool injects
# The `ds_version` of the optimizer state written: the DeepSpeed format it follows (DeepSpeed's loader
# checks it against the versions whose ZeRO-1 layout it reads).
DS_FORMAT_VERSION = "0.19.8"


# the required options, given so the parser yields every default for a caller-built namespace to override
_REQUIRED_PLACEHOLDERS = ["--input_folder", "", "--output_folder", ""]


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ds_to_universal", description="Write a checkpoint as DeepSpeed's universal checkpoint layout."
    )
    parser.add_argument("--input_folder", type=str, required=True, help="a checkpoint's tag folder")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal folder to write")
    parser.add_argument("--num_extract_workers", default=4, type=int, help="threads reading parameters")
    parser.add_argument("--num_merge_workers", default=2, type=int, help="threads writing parameters")
    parser.add_argument(
        "--keep_temp_folder", action="store_true", help="refused: no intermediate fragment files are written"
    )
    parser.add_argument(
        "--no_strict", dest="strict", action="store_false", help="skip reading the written folder back"
    )
    parser.add_argument(
        "--inject_missing_state",
        action="store_true",
        help=f"add '{UNIVERSAL_CHECKPOINT_INFO}' when the checkpoint lacks it (DeepSpeed's engine never writes it)",
    )
    return parser.parse_args(argv)


def _open_source(tag_dir: Path):
    """THE place the source checkpoint is opened: `open_checkpoint` (our checkpoints or DeepSpeed's) where
    the library has it, else our own reader (`tensor_parallel.open_reader`: merged across tensor ranks)."""
    from shardspeed.checkpoint import tensor_parallel, universal

    opener = getattr(universal, "open_checkpoint", None)
    return opener(tag_dir) if opener is not None else tensor_parallel.open_reader(tag_dir)


def main(args=None) -> int:
    """The command (`args`: a parsed namespace, as DeepSpeed's `main(args)` takes, or argv, or None)."""
    if args is None or isinstance(args, (list, tuple)):
        args = parse_arguments(args)
    else:  # a namespace built by the caller (DeepSpeed's tests pass a SimpleNamespace): the options it omits
        args = argparse.Namespace(**{**vars(parse_arguments(_REQUIRED_PLACEHOLDERS)), **vars(args)})
    if getattr(args, "keep_temp_folder", False):
        raise SystemExit(
            "ds_to_universal: --keep_temp_folder is not supported: shardspeed assembles each parameter in memory "
            "and writes no temporary fragment folder to keep"
        )
    for name in ("num_extract_workers", "num_merge_workers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"ds_to_universal: --{name} must be at least 1, got {getattr(args, name)}")
    source, output = Path(args.input_folder), Path(args.output_folder)
    print(f"Converting checkpoint {source} to a universal checkpoint in {output}")
    if zero3_tp.is_deepspeed_zero3_tp(source):  # DeepSpeed's own ZeRO-3 + AutoTP files: merged by their info
        zero3_tp.write_zero3_tp_universal(source, output, validate_autotp_conversion_support)
        print(f"Wrote {output} and {output.parent / layout.LATEST_UNIVERSAL}")
        return 0
    reader = _open_source(source)
    model_states = layout.read_record_file(layout.model_states_file(reader.path))
    if int(model_states.get("mp_world_size", 1)) > 1 and is_deepspeed_state(model_states):
        # DeepSpeed's own AutoTP files: each tensor rank's shards, merged by the checkpoint's info
        validate_autotp_conversion_support(model_states.get(UNIVERSAL_CHECKPOINT_INFO))
        reader = DeepSpeedAutoTPReader(reader.path, model_states)
        model_states = reader.whole_model_states()
    elif int(model_states.get("mp_world_size", 1)) > 1:  # AutoTP shards, merged by the reader: whole values
        from shardspeed.checkpoint.tensor_parallel import whole_model_states

        model_states = whole_model_states(model_states)
    write_universal(
        reader,
        model_states,
        output,
        inject_missing_state=args.inject_missing_state,
        extract_workers=args.num_extract_workers,
        merge_workers=args.num_merge_workers,
        strict=args.strict,
    )
    print(f"Wrote {output} and {output.parent / layout.LATEST_UNIVERSAL}")
    return 0


def command() -> int:
    """The console script: `main`, with a checkpoint's faults reported as a message and exit status 1."""
    try:
        return main()
    except CheckpointError as err:
        print(f"ds_to_universal: {err}", file=sys.stderr)
        return 1


def validate_autotp_conversion_support(universal_info: dict) -> None:
    """Refuse a checkpoint whose `universal_checkpoint_info` lists AutoTP layouts that cannot be merged
    (`autotp_unsupported_parameter_patterns`: pattern -> reason, written by DeepSpeed for interleaved fused
    layouts), naming each; merging them by concatenation would write wrong whole weights. (DeepSpeed's
    `_validate_autotp_conversion_support`; shardspeed's own AutoTP makes no such layout.)"""
    unsupported = (universal_info or {}).get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        listed = "; ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
        raise ValueError(f"ds_to_universal: the checkpoint's AutoTP layout cannot be converted ({listed})")


def write_universal(reader, model_states: dict, output: Path, *, inject_missing_state: bool = False,
                    extract_workers: int = 4, merge_workers: int = 2, strict: bool = True) -> None:  # fmt: skip
    """Write `reader`'s checkpoint (CheckpointReader's interface) as a universal folder at `output`, with
    `model_states` (the source's model-states file) kept beside, and point `latest_universal` at it."""
    validate_autotp_conversion_support(model_states.get(UNIVERSAL_CHECKPOINT_INFO))
    if UNIVERSAL_CHECKPOINT_INFO not in model_states and not inject_missing_state:
        raise CheckpointError(
            f"{reader.path} has no '{UNIVERSAL_CHECKPOINT_INFO}' (engines do not write it; Megatron-DeepSpeed "
            "does): pass --inject_missing_state to add it"
        )
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = files.staging_dir(output.parent, output.name)
    shutil.rmtree(staging, ignore_errors=True)
    (staging / layout.ZERO_FOLDER).mkdir(parents=True)
    try:
        names = [n for n in reader.param_names() if reader.has_value(n)]
        _write_parameters(reader, names, staging / layout.ZERO_FOLDER, extract_workers, merge_workers)
        files.save_file(
            _optimizer_state(reader, names), staging / layout.ZERO_FOLDER / layout.OPTIMIZER_STATE_FILE
        )
        kept = dict(model_states)
        kept["optimizer"] = None  # the optimizer's state is in zero/, by parameter
        kept.setdefault(UNIVERSAL_CHECKPOINT_INFO, dict(UNIVERSAL_CHECKPOINT_VERSION))
        kept.setdefault("mp_world_size", 1)  # read by DeepSpeed's loader
        for name in (files.model_states_name(0), layout.STAGE3_MODEL_STATES):  # ZeRO 1-2 and ZeRO-3 loaders
            files.save_file(kept, staging / name)
        if strict:
            _verify(reader, names, staging)
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files.atomic_write_text(output.parent / layout.LATEST_UNIVERSAL, output.name)


def _parameter_files(reader, name: str) -> dict:
    """{file stem: content} of one parameter's folder: fp32, each per-element optimizer state, the step."""
    value = reader.fp32(name)
    out = {layout.FP32: {layout.PARAM: value, "cat_dim": 0}}
    if reader.has_optimizer_state and reader.param_group_of(name) is not None:
        for key, state in reader.optimizer_state(name).items():
            if key == layout.STEP:
                out[key] = state if torch.is_tensor(state) else torch.tensor(float(state))
            elif torch.is_tensor(state) and state.shape == value.shape:
                out[key] = {layout.PARAM: state.float(), "cat_dim": 0}
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of parameter {name!r} is neither per-element nor the step: the "
                    "universal layout has no place for it"
                )
    return out


def _write_parameters(
    reader, names: list[str], zero_dir: Path, extract_workers: int, merge_workers: int
) -> None:
    def write(item) -> None:
        name, contents = item
        folder = zero_dir / name
        folder.mkdir()
        for stem, content in contents.items():
            files.save_file(content, folder / f"{stem}.pt")

    with ThreadPoolExecutor(extract_workers) as extract, ThreadPoolExecutor(merge_workers) as merge:
        for start in range(0, len(names), extract_workers):  # bounded: one chunk of parameters in memory
            chunk = names[start : start + extract_workers]
            read = list(extract.map(lambda n: (n, _parameter_files(reader, n)), chunk))
            list(merge.map(write, read))


def _optimizer_state(reader, names: list[str]) -> dict:
    """`zero/optimizer_state.pt`: what both of DeepSpeed's loaders read (ZeRO 1-2: `param_groups`,
    `ds_version`; ZeRO-3: `optimizer_state_dict`'s first state's step and first group), plus each group's
    parameter names (shardspeed checks a reload groups parameters alike). No `loss_scaler` entry: DeepSpeed
    keeps one of its own classes there, so an fp16 scale is recorded under `shardspeed_loss_scaler`."""
    groups = reader.param_groups() if reader.has_optimizer_state else []
    by_group = [[n for n in names if reader.param_group_of(n) == gi] for gi in range(len(groups))]
    listed = [{**g, "params": list(range(len(by_group[gi])))} for gi, g in enumerate(groups)]
    step = next(
        (s for n in names if reader.param_group_of(n) is not None
         for k, s in reader.optimizer_state_slice(n, 0, 0)[1].items() if k == layout.STEP),
        None,
    )  # fmt: skip
    state = {
        "param_groups": listed,
        "optimizer_state_dict": {
            "state": {0: {"step": step}} if step is not None else {},
            "param_groups": listed,
        },
        "zero_stage": reader.zero_stage,
        "ds_version": DS_FORMAT_VERSION,
        "shardspeed_version": __version__,
        "shardspeed_param_names": by_group,
    }
    scaler = reader.loss_scaler()
    if scaler is not None:
        state["shardspeed_loss_scaler"] = scaler
        state["dynamic_loss_scale"] = bool(scaler.get("dynamic", True))
    return state


def _verify(reader, names: list[str], staging: Path) -> None:
    """`--strict`: read the written folder back; it must hold every parameter with the source's shape."""
    written = layout.UniversalFolderReader(staging)
    if written.param_names() != names:
        raise CheckpointError(f"universal folder {staging} holds {written.param_names()}, expected {names}")
    for name in names:
        if tuple(written.shape(name)) != tuple(reader.shape(name)):
            raise CheckpointError(
                f"universal folder {staging}: {name!r} written as {tuple(written.shape(name))}, expected "
                f"{tuple(reader.shape(name))}"
            )


def _publish(staging: Path, output: Path) -> None:
    """Rename the finished folder into place (an existing one is replaced only once the new one is whole)."""
    aside = files.replaced_dir(output.parent, output.name)
    if output.exists():
        shutil.rmtree(aside, ignore_errors=True)
        output.rename(aside)
    staging.rename(output)
    files.fsync_dir(output.parent)
    shutil.rmtree(aside, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(command())
