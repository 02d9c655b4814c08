"""Loading weights into a (possibly meta-device, possibly tensor-parallel) model, one tensor at a time.

A model built under ``torch.device("meta")`` has shapes and no storage. After ``shard_model`` has split it,
``load_weights`` walks the checkpoint's safetensors files and, for each tensor, reads it, keeps this rank's
part (``param.tp_partition``, set by module_inject, says which) and drops the rest before the next tensor:
the peak is this rank's share of the model plus one full tensor, so a model larger than one rank's memory
can be served. ``.bin``/``.pt`` files load with ``weights_only=True`` (never arbitrary unpickling).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

__all__ = ["checkpoint_files", "load_weights"]


def checkpoint_files(checkpoint, base_dir: str = "") -> list[Path]:
    """The weight files a checkpoint names: a directory, one file, a list, or DeepSpeed's json descriptor."""
    if isinstance(checkpoint, dict):
        names = checkpoint.get("checkpoints")
        if names is None:
            raise ValueError("checkpoint: a dict checkpoint needs a 'checkpoints' list of files")
        base = Path(base_dir or checkpoint.get("base_dir", ""))
        return [base / name for name in (names if isinstance(names, list) else [names])]
    path = Path(base_dir) / checkpoint if base_dir else Path(checkpoint)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
        if not files:
            raise FileNotFoundError(f"checkpoint: no *.safetensors, *.bin or *.pt files in {path}")
        return files
    if path.suffix == ".json":
        with open(path) as handle:
            return checkpoint_files(json.load(handle), base_dir or str(path.parent))
    if not path.exists():
        raise FileNotFoundError(f"checkpoint: {path} does not exist")
    return [path]


def _tensors(path: Path):
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)
    else:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()


def _local_part(name: str, full: torch.Tensor, target: torch.Tensor, rank: int) -> torch.Tensor:
    part = getattr(target, "tp_partition", None)
    if part is not None:
        from shardspeed.module_inject.layers import shard_tensor

        full = shard_tensor(full, part, rank)
    if full.shape != target.shape:
        raise ValueError(
            f"checkpoint: {name} has shape {tuple(full.shape)}, the model expects {tuple(target.shape)}"
        )
    return full


def load_weights(model: nn.Module, files: list[Path], *, rank: int, dtype: torch.dtype, device) -> list[str]:
    """Fill ``model``'s parameters and persistent buffers from ``files``; returns the names never loaded."""
    slots = dict(model.named_parameters(remove_duplicate=False))
    slots.update(model.named_buffers(remove_duplicate=False))
    missing = set(model.state_dict().keys())
    for path in files:
        for name, full in _tensors(path):
            target = slots.get(name)
            if target is None:
                continue
            local = _local_part(name, full, target, rank)
            value = local.to(device=device, dtype=dtype if local.is_floating_point() else local.dtype)
            _assign(model, name, value, target)
            missing.discard(name)
            del full, local
    return sorted(missing)


def _assign(model: nn.Module, name: str, value: torch.Tensor, target: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if isinstance(target, nn.Parameter):
        param = nn.Parameter(value, requires_grad=False)
        for key, extra in vars(target).items():  # keep tp_partition and friends
            setattr(param, key, extra)
        setattr(owner, attr, param)
    else:
        owner._buffers[attr] = value
