"""Consolidation: turn a checkpoint of any ZeRO stage and world size into one full fp32 state dict.

DeepSpeed's `zero_to_fp32` names (reference §3.6): `get_fp32_state_dict_from_zero_checkpoint`,
`convert_zero_checkpoint_to_fp32_state_dict`, `load_state_dict_from_zero_checkpoint`, the file listers
`get_optim_files` / `get_model_state_files`, and a CLI with the same flags (`shardspeed-zero-to-fp32`, or
`python -m shardspeed.checkpoint.consolidate`). This module is also `deepspeed.utils.zero_to_fp32`
(shardspeed/compat/paths.py), so `python -m deepspeed.utils.zero_to_fp32` runs the same CLI.

The output holds every key of the model's state dict — parameters as their fp32 master values, tied aliases
(as copies in files, shared in memory), persistent buffers (floating ones in fp32) — so
`model.load_state_dict(..., strict=True)` works. Files are safetensors by default (`model.safetensors`, or
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` in Hugging Face's index format when
larger than `max_shard_size`).

Streaming: shard boundaries are planned from the shapes alone, then each file is written one tensor at a
time by the small safetensors writer below — a header first (it only needs shapes and dtypes), then each
tensor's bytes as soon as it is assembled. Peak memory is one parameter plus the memory-mapped inputs
([Note: lazy checkpoint reads] in universal.py), less than DeepSpeed's "one shard". No process group needed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.tensor_parallel import open_reader
from shardspeed.checkpoint.universal import CheckpointReader

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "save_safetensors",
]

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


# -- what the output holds ------------------------------------------------------------------------------------


class _Entry:
    """One output key: its shape and dtype (known without reading), and how to read its value."""

    def __init__(self, key: str, shape, dtype: torch.dtype, read, source: str | None = None):
        self.key, self.shape, self.dtype, self.read = key, tuple(shape), dtype, read
        self.source = source or key  # a tied alias names the parameter it shares storage with

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _output_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float32 if tensor.is_floating_point() else tensor.dtype


def _entries(reader: CheckpointReader, exclude_frozen_parameters: bool) -> list[_Entry]:
    """Every state-dict key the output will hold, in the model's order."""
    shared, frozen = reader.shared_params(), set(reader.frozen_param_names())
    buffers = set(reader.buffer_names())
    entries = []
    for key in reader.state_dict_keys():
        if key in buffers:
            value = reader.buffer(key)  # memory-mapped: its shape and dtype cost no read
            entries.append(_Entry(key, value.shape, _output_dtype(value), _buffer_reader(reader, key)))
            continue
        source = shared.get(key, key)
        if exclude_frozen_parameters and source in frozen:
            continue
        entries.append(
            _Entry(key, reader.shape(source), torch.float32, _param_reader(reader, source), source)
        )
    return entries


def _param_reader(reader: CheckpointReader, name: str):
    return lambda: reader.fp32(name)


def _buffer_reader(reader: CheckpointReader, name: str):
    def read() -> torch.Tensor:
        value = reader.buffer(name)
        return value.float() if value.is_floating_point() else value.clone()

    return read


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> OrderedDict:
    """The full fp32 state dict of a checkpoint, in memory (DeepSpeed's function of the same name).

    `checkpoint_dir` holds `latest` and the tag folders (a tag folder itself works too); `tag` defaults to
    the one in `latest`. Tied weights share one tensor, as in the model. `lazy_mode` is accepted for
    DeepSpeed compatibility; the tensors are always materialised (use `CheckpointReader` for lazy reads).
    """
    del lazy_mode
    reader = open_reader(checkpoint_dir, tag)  # tensor-parallel shards merged
    shared = reader.shared_params()
    state: OrderedDict = OrderedDict()
    for entry in _entries(reader, exclude_frozen_parameters):
        source = shared.get(entry.key)
        state[entry.key] = state[source] if source in state else entry.read()
    return state


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Load the consolidated fp32 weights into `model` (moved to CPU, as DeepSpeed does) and return it.

    Like DeepSpeed's, the load is not strict, and the model should not be used in an engine afterwards:
    make a new engine from it instead.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _natural_key(text: str) -> list:
    """Sort key putting "rank_2" before "rank_10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir, glob_pattern: str) -> list[str]:
    """The files of `checkpoint_dir` matching `glob_pattern`, in natural order (rank 2 before rank 10)."""
    found = sorted((str(p) for p in Path(checkpoint_dir).glob(glob_pattern)), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"no files matching {glob_pattern!r} in {checkpoint_dir}")
    return found


def get_optim_files(checkpoint_dir) -> list[str]:
    """The `*_optim_states.pt` files of a tag folder, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir) -> list[str]:
    """The `*_model_states.pt` files of a tag folder, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


# -- writing --------------------------------------------------------------------------------------------------


def parse_size(size) -> int:
    """ "5GB" -> 5 * 10**9, "5GiB" -> 5 * 2**30, "200KB", or a number of bytes (Hugging Face's convention)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
    if match is None:
        raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB', '500MB' or 1000000")
    unit = match.group(2) or "B"
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base**power)


def _plan_shards(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Greedy split in key order; a tensor larger than `max_bytes` gets a file of its own."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_tensor_bytes(f, tensor: torch.Tensor) -> None:
    """Write a tensor's raw bytes without a copy. Tensors have no buffer protocol and `.numpy()` needs NumPy,
    which a clean install lacks, so the bytes are read through ctypes at the tensor's address (`tensor` is
    held by this frame while they are written)."""
    tensor = tensor.cpu().contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes:
        f.write(memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B"))


def save_safetensors(state: dict, path, metadata: dict[str, str] | None = None) -> None:
    """Write `state` (name -> tensor) as one safetensors file without NumPy, which `safetensors.torch.save_file`
    needs and a clean install lacks. Tensors keep their dtype; tied aliases are written as separate entries.
    `metadata`: extra string entries of the header's `__metadata__`."""
    entries = [
        _Entry(key, value.shape, value.dtype, lambda value=value: value.detach())
        for key, value in state.items()
    ]
    _write_safetensors(Path(path), entries, metadata)


def _write_safetensors(path: Path, entries: list[_Entry], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written one tensor at a time.

    Format: an 8-byte little-endian header length, a JSON header of {key: dtype, shape, data_offsets} padded
    with spaces to a multiple of 8, then the tensors' bytes back to back. Tensors are laid out by descending
    element size so every tensor starts aligned to its own size, as the reference writer does.
    """
    ordered = sorted(entries, key=lambda e: -e.dtype.itemsize)
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for entry in ordered:
        header[entry.key] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    tmp = _private_tmp(path)
    with open(tmp, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for entry in ordered:
            value = entry.read().to(entry.dtype).contiguous()
            if tuple(value.shape) != entry.shape:
                raise RuntimeError(f"{entry.key}: read shape {tuple(value.shape)}, planned {entry.shape}")
            _write_tensor_bytes(f, value)
            del value  # one tensor at a time
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _private_tmp(path: Path) -> Path:
    """This process's temporary name for `path`: when every rank of a job converts the same checkpoint into
    the same folder (DeepSpeed's scripts do), one shared name lets one rank rename away the file another
    is still writing; with one name per process each rank's rename is whole and the last one wins."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _write_torch(path: Path, entries: list[_Entry]) -> None:
    """pytorch_model.bin style: torch.save needs the whole shard in memory (use safetensors for streaming).

    Tied aliases hold the very tensor of the parameter they share (read once), as in the model and in
    DeepSpeed's output: torch.save stores it once and loading gives one tensor under both keys.
    """
    tmp = _private_tmp(path)
    values: dict[str, torch.Tensor] = {}
    state = {}
    for e in entries:
        if e.source not in values:
            values[e.source] = e.read()
        state[e.key] = values[e.source]
    torch.save(state, tmp)
    os.replace(tmp, path)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization: bool = False,
    tag=None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the full fp32 state dict of a checkpoint into `output_dir`; returns the files written.

    One `pytorch_model.bin`, as DeepSpeed writes by default (or `model.safetensors` with
    `safe_serialization=True`), or numbered shards and an index when the total exceeds `max_shard_size`
    (None: never shard). Both load with weights only (`torch.load(weights_only=True)`, safetensors).
    """
    reader = open_reader(checkpoint_dir, tag)  # tensor-parallel shards merged
    entries = _entries(reader, exclude_frozen_parameters)
    total = sum(e.nbytes for e in entries)
    shards = [entries] if max_shard_size is None else _plan_shards(entries, parse_size(max_shard_size))
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    write = _write_safetensors if safe_serialization else _write_torch
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        names = [f"{stem}.{ext}"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    written = []
    for name, shard in zip(names, shards):
        write(output / name, shard)
        written.append(output / name)
        logger.info(f"wrote {output / name} ({len(shard)} tensors)")
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {e.key: name for name, shard in zip(names, shards) for e in shard},
        }
        index_path = output / f"{stem}.{ext}.index.json"
        tmp = _private_tmp(index_path)
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, index_path)
        written.append(index_path)
    return written


# -- CLI ------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="shardspeed-zero-to-fp32",
        description="Consolidate a shardspeed (ZeRO) checkpoint into one fp32 state dict (DeepSpeed's "
        "zero_to_fp32.py flags). Works on any stage and world size; needs no GPU and no process group.",
    )
    parser.add_argument(
        "checkpoint_dir", help="folder holding 'latest' and the tag folders, e.g. path/checkpoint-12"
    )
    parser.add_argument("output_dir", help="folder to write pytorch_model.bin (or shards and an index) into")
    parser.add_argument(
        "--max_shard_size",
        default="5GB",
        help="largest output file before sharding (default 5GB; e.g. 500MB)",
    )
    parser.add_argument(
        "--safe_serialization",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="write model.safetensors instead of pytorch_model.bin (DeepSpeed's default)",
    )
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out"
    )
    parser.add_argument("-d", "--debug", action="store_true", help="log each file written")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.debug else logging.WARNING, format="%(message)s")
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (CheckpointError, ValueError) as err:
        print(f"shardspeed-zero-to-fp32: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} file(s) to {args.output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
