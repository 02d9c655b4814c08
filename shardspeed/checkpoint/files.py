"""Checkpoint file primitives: atomic writes, safe reads, and the on-disk names.

Safety rules every checkpoint write and read follows:
- a tag is written into a hidden staging folder and renamed into place only when every rank has finished,
  and `latest` is replaced atomically afterwards, so a crash mid-save leaves the previous `latest` loadable;
- every file is fsynced before it is renamed, and every folder whose entries changed is fsynced after, so
  the order above also holds after a power loss (a rename is only durable once its folder is synced);
- reads use `torch.load(weights_only=True)`: a checkpoint can never execute code when it is loaded, and a
  file that cannot be read is reported with what is wrong with it (missing, a folder, empty, truncated).
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import torch

LATEST = "latest"
# torch.save writes a zip archive; its first bytes are a zip local-file header.
_ZIP_MAGIC = b"PK\x03\x04"


class CheckpointError(RuntimeError):
    """A checkpoint is corrupt, incomplete or does not match the model/engine loading it."""


def model_states_name(mp_rank: int = 0) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_optim_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    """Per-rank optimizer partition of a ZeRO stage >= 1 checkpoint (DeepSpeed's name)."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def expert_model_states_name(layer_id: int, expert_id: int, mp_rank: int = 0) -> str:
    """Expert `expert_id` (its global index) of the `layer_id`-th MoE layer (DeepSpeed's name)."""
    return f"layer_{layer_id}_expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_universal_name(layer_id: int, expert_id: int) -> str:
    """An MoE checkpoint's by-name file of one expert: fp32 values and optimizer state (moe/checkpoint.py)."""
    return f"layer_{layer_id}_expert_{expert_id}_universal_states.pt"


MOE_DENSE_UNIVERSAL = "moe_dense_universal_states.pt"  # the same for every dense parameter of an MoE model


def moe_optim_states_name(dp_rank: int) -> str:
    """Data-parallel rank `dp_rank`'s optimizer state (every reduction domain) in an MoE checkpoint."""
    return f"moe_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def expert_optim_states_name(ep_rank: int, mp_rank: int = 0) -> str:
    """DeepSpeed's file of expert-parallel rank `ep_rank`'s whole optimizer state in a ZeRO stage 0 checkpoint
    of a model with MoE layers (shardspeed reads it from DeepSpeed's checkpoints; its own are `moe_rank_*`)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def rng_states_name(rank: int) -> str:
    return f"rng_states_rank_{rank}.pt"


def staging_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.incomplete"


def replaced_dir(save_dir: Path, tag: str) -> Path:
    """Where the previous copy of a tag waits while a re-save of the same tag is renamed into place."""
    return save_dir / f".{tag}.replaced"


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (files created, renamed or removed in it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # platforms that cannot open a folder (Windows) have no folder fsync either
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders; their renames are then as durable as they get
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step: readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_file(obj, path: Path, pickle_module=None) -> None:
    """torch.save through a temporary name, fsynced, so `path` is either complete or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        if pickle_module is None:
            torch.save(obj, f)
        else:  # DeepSpeed's layout (deepspeed_format/pickled.py)
            torch.save(obj, f, pickle_module=pickle_module)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def check_loadable(obj, what: str) -> None:
    """Refuse, before anything is written, state that a weights-only load could not read back."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
    except Exception as err:  # e.g. a lambda or an open file: nothing a checkpoint can hold
        raise TypeError(f"{what} cannot be saved ({type(err).__name__}: {err})") from err
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as err:
        raise TypeError(
            f"{what} holds objects that a safe (weights_only) load cannot restore; keep it to tensors, "
            f"numbers, strings, lists, tuples and dicts. Loader said: {str(err).splitlines()[0]}"
        ) from err


def diagnose(path: Path) -> str | None:
    """What is wrong with checkpoint file `path` on sight (without unpickling it), or None."""
    if not path.exists():
        return "is missing: the checkpoint is incomplete"
    if path.is_dir():
        return "is a folder, where a checkpoint file should be"
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes): it was never written completely"
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if head != _ZIP_MAGIC:
        return "is not a torch checkpoint (it does not start with the zip signature torch.save writes)"
    if not zipfile.is_zipfile(path):
        return f"is truncated ({size} bytes, the zip directory at its end is missing): it was not completely written"
    return None


def read_checkpoint(path: Path, mmap: bool = False) -> dict:
    """A checkpoint file's content, read safely; a CheckpointError naming the file and its fault if not."""
    problem = diagnose(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint file {path} {problem}")
    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint file {path} could not be read (corrupt, or holds objects a safe load refuses): {err}"
        ) from err
    if not isinstance(content, dict):
        raise CheckpointError(
            f"checkpoint file {path} holds a {type(content).__name__}, not a checkpoint dict"
        )
    return content


def load_file(path: Path) -> dict:
    return read_checkpoint(path)


def tag_folder(root: Path, tag: str) -> Path:
    """The folder of checkpoint `tag`. A re-save of an existing tag moves the old copy aside before it
    renames the new one into place; if the job died between the two renames, the old copy (complete) is
    where the tag is found until the next save of that tag."""
    path = root / tag
    aside = replaced_dir(root, tag)
    if not path.exists() and aside.is_dir():
        return aside
    return path


def read_latest(load_dir: Path) -> str | None:
    """The tag `<load_dir>/latest` names, None when there is no `latest` file."""
    latest = load_dir / LATEST
    if not latest.exists():
        return None
    if latest.is_dir():
        raise CheckpointError(f"{latest} is a folder: it should be a text file naming the newest tag")
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{latest} cannot be read as text: {err}") from err
    if not tag:
        raise CheckpointError(f"{latest} is empty: it should name the tag of the newest checkpoint")
    if "/" in tag or "\\" in tag or tag.startswith(".") or "\n" in tag:
        raise CheckpointError(f"{latest} names {tag!r}, which is not a checkpoint tag (a plain folder name)")
    return tag
