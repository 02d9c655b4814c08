"""The named-state protocol: every stateful part of an engine saves and loads its own state, under its own
name; the checkpoint code (checkpoint/engine_io.py) loops over the engine's list of parts and knows none.

Contract of a `CheckpointPart` (the engine's list gives the order of every step below):

- `name`: stable and unique within the list; errors name the part by it.
- `keys`: the entries of the model-states file (`mp_rank_XX_model_states.pt`) the part owns, under their
  on-disk names. Parts own disjoint keys; an entry no part owns is the client's state. Another layout
  (DeepSpeed's own) is read or written by remapping these keys, part by part.
- `state_dict(options) -> {key: value}`: the part's entries (a subset of `keys`), written into the
  model-states file by the rank that writes it (data-parallel rank 0 of each model-parallel rank). Values
  must load with `torch.load(weights_only=True)`. No collective.
- `write_files(staging, options)`: files the part writes itself besides the model-states file (per-rank
  optimizer partitions, MoE expert files, pipeline layer files, RNG streams). Called on every rank, so it
  may be collective; a failure is agreed by every rank after all parts wrote (checkpoint/agree.py).
- `check(path, state, options)`: before anything is loaded, on every rank: raise `CheckpointError` naming
  what is wrong (the verdicts of all ranks are agreed). `state` is this rank's model-states file.
- `optional`: a checkpoint holding none of `keys` is fine (the part keeps its state); otherwise it is an
  error naming the part, raised at the check, before anything is loaded.
- `holds_weights`: the part loads with `load_module_only=True` (the module's weights); the others do not.
- `load_state_dict(entries, ctx)`: restore from `entries` ({key: value} of its keys present in the file),
  after every check passed on every rank. `ctx.options` says what the caller asked for; `ctx.state` is the
  whole model-states file (for the layout other parts recorded); a part that loaded across a layout change
  (another world size, stage or degree) sets `ctx.resharded` for the parts after it.

`Part` gives the defaults (no keys, no files, no check, not optional); `NamedState` is one object's own
`state_dict()` under one key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shardspeed.checkpoint.files import CheckpointError

__all__ = [
    "CheckpointPart",
    "ConfigRecord",
    "LoadContext",
    "LoadOptions",
    "NamedState",
    "Part",
    "Placement",
    "SaveOptions",
    "check_present",
    "owned_keys",
]


@dataclass(frozen=True)
class Placement:
    """This rank's place in the job, as checkpoint files are named and checked by it."""

    device: Any  # where collectives of this rank run (the agreement between ranks)
    global_rank: int
    dp_rank: int
    dp_world_size: int
    mp_rank: int = 0  # the model-parallel rank: which mp_rank_XX files this rank writes and reads


@dataclass(frozen=True)
class SaveOptions:
    """What `save_checkpoint` was asked for, beyond where to save."""

    exclude_frozen: bool = False


@dataclass(frozen=True)
class LoadOptions:
    """What `load_checkpoint` was asked for, beyond where to load from."""

    strict: bool = True
    load_optimizer_states: bool = True
    load_scheduler_states: bool = True
    module_only: bool = False
    universal: bool = False  # `checkpoint.load_universal`: the folder is DeepSpeed's universal layout

    @property
    def optimizer(self) -> bool:
        """Optimizer state is restored (not with `load_module_only`)."""
        return self.load_optimizer_states and not self.module_only


@dataclass
class LoadContext:
    """One load in progress, handed to each part in turn."""

    path: Path
    options: LoadOptions
    state: dict  # this rank's model-states file
    resharded: bool = False  # set by a part that loaded across a layout change


@runtime_checkable
class CheckpointPart(Protocol):
    name: str
    keys: tuple[str, ...]
    optional: bool
    holds_weights: bool

    def state_dict(self, options: SaveOptions) -> dict[str, Any]: ...

    def write_files(self, staging: Path, options: SaveOptions) -> None: ...

    def check(self, path: Path, state: dict, options: LoadOptions) -> None: ...

    def load_state_dict(self, entries: dict[str, Any], ctx: LoadContext) -> None: ...


class Part:
    """Defaults of the protocol: a part with no entries, no files of its own and nothing to check."""

    name = "part"
    keys: tuple[str, ...] = ()
    optional = False
    holds_weights = False

    def state_dict(self, options: SaveOptions) -> dict[str, Any]:
        return {}

    def write_files(self, staging: Path, options: SaveOptions) -> None:
        return None

    def check(self, path: Path, state: dict, options: LoadOptions) -> None:
        return None

    def load_state_dict(self, entries: dict[str, Any], ctx: LoadContext) -> None:
        return None


class NamedState(Part):
    """`obj.state_dict()` under the entry `key` (None when there is no object). On load the saved value is
    handed to `obj.load_state_dict` unless it is None or there is no object; with `scheduler=True` only when
    the caller asked for scheduler states (`load_lr_scheduler_states`). Optional: a checkpoint without the
    entry leaves the object as it is."""

    optional = True

    def __init__(self, key: str, obj, *, scheduler: bool = False):
        self.name = key
        self.keys = (key,)
        self.obj = obj
        self.scheduler = scheduler

    def state_dict(self, options: SaveOptions) -> dict[str, Any]:
        return {self.name: self.obj.state_dict() if self.obj is not None else None}

    def load_state_dict(self, entries: dict[str, Any], ctx: LoadContext) -> None:
        if self.scheduler and not ctx.options.load_scheduler_states:
            return
        value = entries.get(self.name)
        if self.obj is not None and value is not None:
            self.obj.load_state_dict(value)


class ConfigRecord(Part):
    """The config and versions the checkpoint was written with: recorded, never loaded back."""

    name = "config"
    keys = ("ds_config", "ds_version", "shardspeed_version")
    optional = True

    def __init__(self, raw_config, version: str):
        self.raw_config = raw_config
        self.version = version

    def state_dict(self, options: SaveOptions) -> dict[str, Any]:
        return {"ds_config": self.raw_config, "ds_version": self.version, "shardspeed_version": self.version}


def owned_keys(parts) -> set[str]:
    """Every model-states entry some part owns (the rest of the file is the client's state)."""
    return {key for part in parts for key in part.keys}


def check_present(parts, path: Path, state: dict, file_name: str) -> None:
    """A part that is not optional must find at least one of its entries in the model-states file."""
    for part in parts:
        if part.optional or not part.keys or any(k in state for k in part.keys):
            continue
        raise CheckpointError(
            f"{path / file_name} holds no state of part {part.name!r} (none of {list(part.keys)}): saved "
            "by an engine without that part, or not a checkpoint of this engine"
        )
