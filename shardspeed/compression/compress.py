"""``init_compression``, ``redundancy_clean`` and ``student_initialization`` (``deepspeed.compression.compress``).

Module selection: each group's ``modules`` patterns are searched (``re.search``) in the names of the
model's compressible modules (Linear, Conv2d, Embedding, BatchNorm2d; ``"*"`` = every Linear and Conv2d).
A module may belong to one group per technique; a pattern that matches nothing is an error (0.18.9 skips
it silently). ``related_modules[i]`` lists, per pattern, the modules whose inputs shrink with the pruned
outputs of ``modules[i]``: the j-th match of each related pattern goes with the j-th match of the pattern
(layer by layer), and the counts must agree.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torch import nn

from shardspeed.config.compression import TECHNIQUES, build_compression_config

from . import constants as C
from .compressible import Compressible
from .helper import compression_preparation, fix_compression, is_module_compressible, recursive_getattr

__all__ = [
    "get_compress_methods",
    "get_module_name",
    "init_compression",
    "redundancy_clean",
    "student_initialization",
]

KEY = "compression_training"


def _inner(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def get_module_name(group_name, model, key_word, exist_module_name, mpu=None, verbose=True):
    """Names of compressible modules matching ``key_word`` not yet in ``exist_module_name`` (which is
    updated); a module already claimed by another group of the technique is an error when ``verbose``."""
    found = []
    for name, module in model.named_modules():
        if not name or not is_module_compressible(module, mpu):
            continue
        if key_word == "*":  # DeepSpeed's documented default: every Linear and Conv2d layer
            if isinstance(module, nn.Embedding) or not isinstance(
                module, (nn.Linear, nn.Conv2d, Compressible)
            ):
                continue
        elif re.search(key_word, name) is None:
            continue
        if name in exist_module_name:
            if verbose:
                raise ValueError(
                    f"{KEY}: module {name} is matched by group {group_name!r} and by an earlier group of the "
                    f"same technique; make the patterns disjoint"
                )
            continue
        exist_module_name.add(name)
        found.append(name)
    return found, exist_module_name


def _merged_params(block: Any, group: Any) -> dict:
    """The group's params with the technique's shared parameters on top (DeepSpeed's merge order); shared
    keys left unset (snip_momentum's) do not hide the group's."""
    shared = {k: v for k, v in dataclasses.asdict(block.shared_parameters).items() if v is not None}
    merged = {**dataclasses.asdict(group.params), **shared}
    if getattr(group.params, "quantize_groups", None) is not None:  # a group's own count (beyond 0.18.9)
        merged["quantize_groups"] = group.params.quantize_groups
    return merged


def get_compress_methods(model, compress_methods, mpu=None, require_matches: bool = True):
    """``[[names per pattern], [[related names per related pattern] per pattern], {technique: params}]`` for
    every group of every enabled technique."""
    config = build_compression_config(compress_methods)
    items = []
    for technique in TECHNIQUES:
        block = config.technique(technique)
        if not block.shared_parameters.enabled:
            continue
        claimed: set[str] = set()
        for group_name, group in block.different_groups.items():
            where = f"{KEY}.{technique}.different_groups.{group_name}"
            names = []
            for i, pattern in enumerate(group.modules):
                matched, claimed = get_module_name(group_name, model, pattern, claimed, mpu)
                if not matched and require_matches:
                    raise ValueError(
                        f"{where}.modules[{i}]: {pattern!r} matches no Linear/Conv2d/Embedding module"
                    )
                names.append(matched)
            related = []
            for i, patterns in enumerate(group.related_modules or []):
                lists = [get_module_name(group_name, model, p, set(), mpu)[0] for p in patterns]
                for j, (pattern, matched) in enumerate(zip(patterns, lists)):
                    if len(matched) != len(names[i]) and require_matches:
                        raise ValueError(
                            f"{where}.related_modules[{i}][{j}]: {pattern!r} matches {len(matched)} modules "
                            f"but modules[{i}] matches {len(names[i])}; they are paired one to one"
                        )
                related.append(lists)
            items.append([names, related, {technique: _merged_params(block, group)}])
    return items


def init_compression(model, deepspeed_config, teacher_model=None, mpu=None):
    """Swap the model's layers for compression layers and set up every enabled technique (in place).

    ``deepspeed_config``: a config dict or JSON path (its ``compression_training`` block is read).
    ``teacher_model``: needed by ``layer_reduction``. Returns ``model``.
    """
    config = build_compression_config(deepspeed_config)
    inner = _inner(model)
    if config.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError(f"{KEY}.layer_reduction is enabled: pass teacher_model= to init_compression")
        student_initialization(inner, teacher_model, config)
    items = get_compress_methods(inner, config, mpu)
    _check_quantized(inner, items)
    compression_preparation(inner, items, mpu)
    return model


def _check_quantized(model: nn.Module, items) -> None:
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{name}.{param_name}")
    for names, _, technique in items:
        params = technique.get(C.WEIGHT_QUANTIZATION)
        if params is None:
            continue
        for name in (n for group in names for n in group):
            weight = recursive_getattr(model, name).weight
            shared = [o for o in owners[id(weight)] if o != f"{name}.weight"]
            if shared:
                raise ValueError(
                    f"{KEY}.weight_quantization: {name}.weight is tied to {shared[0]}; quantizing it would "
                    f"change both layers. Leave one of them out of the groups' modules (or untie the weights)"
                )
            groups = params[C.WEIGHT_QUANTIZE_GROUPS]
            if not isinstance(recursive_getattr(model, name), nn.Embedding) and weight.numel() % groups:
                raise ValueError(
                    f"{KEY}.weight_quantization quantize_groups: {groups} does not divide the "
                    f"{weight.numel()} weights of {name}"
                )


def redundancy_clean(model, deepspeed_config, mpu=None):
    """Make the compression permanent: quantized weights become packed integer codes with group scales,
    masks are applied, and pruned rows / heads / channels are removed (with the related modules' inputs).
    The cleaned model computes what the compressed one did. Returns ``model`` (changed in place)."""
    from .packed import pack_compressed

    config = build_compression_config(deepspeed_config)
    inner = _inner(model)
    items = get_compress_methods(inner, config, mpu)
    order = list(TECHNIQUES)
    items.sort(key=lambda item: order.index(next(iter(item[2]))))
    for names, related, technique in items:
        for i, group in enumerate(names):
            masks = [fix_compression(inner, name, technique, dim_reduction=bool(related)) for name in group]
            if not related:
                continue
            for related_names in related[i]:
                for name, mask in zip(related_names, masks):
                    fix_compression(inner, name, technique, mask=mask, dim_reduction=True)
            if C.HEAD_PRUNING in technique:
                _update_head_counts(
                    inner, related[i], masks, technique[C.HEAD_PRUNING][C.HEAD_PRUNING_NUM_HEADS]
                )
    pack_compressed(inner)
    return model


_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_WIDTH_ATTRS = ("all_head_size", "inner_dim", "embed_dim_qkv")


def _update_head_counts(model: nn.Module, related, masks, num_heads: int) -> None:
    """After heads are removed from q/k/v, the attention modules holding them count the kept heads."""
    for names in related:
        for name, mask in zip(names, masks):
            parent_name = name.rpartition(".")[0]
            parent = recursive_getattr(model, parent_name) if parent_name else model
            kept = int(mask.sum())
            width = recursive_getattr(model, name).weight.shape[0]
            for attr in _HEAD_ATTRS:
                if getattr(parent, attr, None) == num_heads:
                    setattr(parent, attr, kept)
            for attr in _WIDTH_ATTRS:
                if isinstance(getattr(parent, attr, None), int):
                    setattr(parent, attr, width)


def student_initialization(student_model, teacher_model, deepspeed_config):
    """Copy ``teacher_layer[i]`` of the teacher into student layer i (under ``module_name_prefix``), and the
    ``other_module_name`` modules whole. Parameter names and shapes must match."""
    config = build_compression_config(deepspeed_config).layer_reduction
    where = f"{KEY}.layer_reduction"
    prefix = config.module_name_prefix
    teacher_layers = recursive_getattr(teacher_model, prefix)
    for student_index, teacher_index in enumerate(config.teacher_layer):
        if teacher_index >= len(teacher_layers):
            raise ValueError(
                f"{where}.teacher_layer: layer {teacher_index} does not exist ({prefix} has {len(teacher_layers)})"
            )
        _copy(
            recursive_getattr(student_model, f"{prefix}.{student_index}"),
            teacher_layers[teacher_index],
            f"{prefix}.{student_index} <- teacher {prefix}.{teacher_index}",
        )
    for name in config.other_module_name:
        _copy(recursive_getattr(student_model, name), recursive_getattr(teacher_model, name), name)


def _copy(student: nn.Module, teacher: nn.Module, what: str) -> None:
    s_params, t_params = dict(student.named_parameters()), dict(teacher.named_parameters())
    if s_params.keys() != t_params.keys():
        raise ValueError(
            f"layer_reduction {what}: parameters differ ({sorted(s_params)} vs {sorted(t_params)})"
        )
    for key, s in s_params.items():
        if s.shape != t_params[key].shape:
            raise ValueError(
                f"layer_reduction {what}: {key} has shape {tuple(s.shape)} in the student, "
                f"{tuple(t_params[key].shape)} in the teacher"
            )
        s.data.copy_(t_params[key].data)
