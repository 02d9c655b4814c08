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

__all__ = ["checkpoint_files", "load_weights", "prepare_packed"]


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


def prepare_packed(model: nn.Module, files: list[Path], tp_size: int = 1) -> dict[str, str]:
    """A packed compressed checkpoint (shardspeed.compression's ``export_packed``): swap the model's layers
    for packed ones of the recorded layouts so its codes and scales load by name. Returns its aliases."""
    from shardspeed.compression.export import is_packed_file, make_packed_shells, packed_layers

    packed = [path for path in files if is_packed_file(path)]
    if not packed:
        return {}
    if tp_size > 1:
        raise ValueError("checkpoint: a packed compressed checkpoint is served at tensor_parallel.tp_size 1")
    aliases: dict[str, str] = {}
    for path in packed:
        layers, file_aliases = packed_layers(path)
        make_packed_shells(model, layers)
        aliases.update(file_aliases)
    return aliases


def load_weights(model: nn.Module, files: list[Path], *, rank: int, dtype: torch.dtype, device,
                 aliases: dict[str, str] | None = None) -> list[str]:  # fmt: skip
    """Fill ``model``'s parameters and persistent buffers from ``files``; returns the names never loaded.
    ``aliases``: names a file wrote once for several (tied) tensors, loaded into each of them."""
    slots = dict(model.named_parameters(remove_duplicate=False))
    slots.update(model.named_buffers(remove_duplicate=False))
    missing = set(model.state_dict().keys())
    copies: dict[str, list[str]] = {}
    for alias, source in (aliases or {}).items():
        copies.setdefault(source, []).append(alias)
    for path in files:
        for name, full in _tensors(path):
            for target_name in [name, *copies.get(name, [])]:
                target = slots.get(target_name)
                if target is None:
                    continue
                local = _local_part(target_name, full, target, rank)
                keep = (
                    local.dtype
                    if not local.is_floating_point() or _keeps_dtype(model, target_name)
                    else dtype
                )
                _assign(model, target_name, local.to(device=device, dtype=keep), target)
                missing.discard(target_name)
                del local
            del full
    return sorted(missing)


def _keeps_dtype(model: nn.Module, name: str) -> bool:
    """Buffers a module lists in ``KEEP_DTYPE_BUFFERS`` (packed weights' fp32 scales) keep the file's dtype."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return attr in getattr(owner, "KEEP_DTYPE_BUFFERS", ())


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
