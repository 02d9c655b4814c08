"""Checkpoint file primitives: atomic writes, safe reads, and the on-disk names.

Safety rules every checkpoint write and read follows:
- a tag is written into a hidden staging folder and renamed into place only when every rank has finished,
  and `latest` is replaced atomically afterwards, so a crash mid-save leaves the previous `latest` loadable;
- reads use `torch.load(weights_only=True)`: a checkpoint can never execute code when it is loaded.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is corrupt, incomplete or does not match the model/engine loading it."""


def model_states_name(mp_rank: int = 0) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_optim_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    """Per-rank optimizer partition of a ZeRO stage >= 1 checkpoint (DeepSpeed's name)."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def rng_states_name(rank: int) -> str:
    return f"rng_states_rank_{rank}.pt"


def staging_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.incomplete"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_file(obj, path: Path) -> None:
    """torch.save through a temporary name, fsynced, so `path` is either complete or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_loadable(obj, what: str) -> None:
    """Refuse, before anything is written, state that a weights-only load could not read back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as err:
        raise TypeError(
            f"{what} holds objects that a safe (weights_only) load cannot restore; keep it to tensors, "
            f"numbers, strings, lists, tuples and dicts. Loader said: {str(err).splitlines()[0]}"
        ) from err


def load_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint file {path} could not be read (corrupt or not a checkpoint): {err}"
        ) from err


def read_latest(load_dir: Path) -> str | None:
    latest = load_dir / LATEST
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    if not tag:
        raise CheckpointError(f"{latest} is empty: it should name the tag of the newest checkpoint")
    return tag
