"""Whole tensors from tensor-parallel shards: gather one, gather a state dict, re-split a full state dict;
and the layout described for universal checkpoints (`universal_checkpoint_info`).

Sharded parameters carry their `TPPartition` (layers.py); everything else is replicated over the tensor
group and read as is. Gathers are collective over the tensor group (every tensor rank calls, in the same
parameter order).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.module_inject.layers import (
    LinearLayer,
    TPPartition,
    gather_shards,
    shard_tensor,
)
from shardspeed.module_inject.tp_uc_meta import param_uc_conversion_meta
from shardspeed.module_inject.vocab_parallel import VocabParallelEmbedding, VocabParallelLMHead

__all__ = [
    "gather_full",
    "partitions_of",
    "reshard_state_dict",
    "tp_full_state_dict",
    "universal_checkpoint_info",
]

# DeepSpeed 0.19.8's universal-checkpoint info keys (checkpoint/constants.py names them too)
_VERSION, _ROW, _REPLICATED = (
    "universal_checkpoint_version",
    "parameter_with_row_parallelism_patterns",
    ("tp_replicated_parameter_patterns"),
)
_VOCAB, _SUB_PARAMS, _VOCAB_SIZE = (
    "vocabulary_parameter_patterns",
    "parameter_with_sub_params",
    "original_vocab_size",
)
_UNSUPPORTED = "autotp_unsupported_parameter_patterns"
_WIDTHS = "sub_param_shard_widths"
_LM_HEAD_NAMES = ("lm_head", "embed_out")


def partitions_of(module: nn.Module) -> dict[str, TPPartition]:
    """State-dict name -> partition of every sharded parameter (tied names included)."""
    return {
        name: p.tp_partition
        for name, p in module.named_parameters(remove_duplicate=False)
        if getattr(p, "tp_partition", None) is not None
    }


def gather_full(tensor: torch.Tensor, part: TPPartition, group) -> torch.Tensor:
    """The whole tensor from every tensor rank's shard (collective over `group`)."""
    shards = [torch.empty_like(tensor) for _ in range(part.tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return gather_shards(shards, part)


def tp_full_state_dict(module: nn.Module, group, state: dict | None = None) -> dict[str, torch.Tensor]:
    """`module.state_dict()` (or `state`) with every sharded entry gathered whole."""
    parts = partitions_of(module)
    state = module.state_dict() if state is None else state
    return {k: gather_full(v, parts[k], group) if k in parts else v for k, v in state.items()}


def reshard_state_dict(full: dict, parts: dict[str, TPPartition], rank: int) -> dict:
    """This rank's shards of a full state dict (entries without a partition are kept whole)."""
    return {k: shard_tensor(v, parts[k], rank).clone() if k in parts else v for k, v in full.items()}


def _publish_conversion(info: dict, widths: dict, pattern: str, conversion: dict) -> None:
    """One marked parameter's entries: row-parallel weights, whole-on-every-rank parameters, fused parts
    (their shape spec with the parts' sizes at the split dimension, never a count, and each rank's widths)."""
    if conversion.get("replicated"):
        info[_REPLICATED].append(pattern)
    # DeepSpeed's converter joins a "row-parallel" weight along dim 1 and any other along dim 0: the list is
    # the weights split along dim 1. That is a row layer's weight in nn.Linear's [out, in] orientation, but a
    # *column* layer's in Conv1D's [in, out] (GPT-2), which AutoTP keeps as it is (a Conv1D row weight is
    # split along dim 0, joined by the default).
    if conversion.get("partition_dim") == 1 and not conversion.get("is_bias"):
        info[_ROW].append(pattern)
    spec, dim = conversion.get("sub_param_shape"), conversion.get("partition_dim")
    if spec is not None and dim is not None:
        shape = list(spec)
        parts = conversion.get("sub_param_shard_widths")
        if parts is not None:
            shape[dim] = tuple(sum(w) for w in parts)
            widths[pattern] = [list(w) for w in parts]
        info[_SUB_PARAMS].append({"patterns": [pattern], "shape": shape, "partition_dim": dim})


def universal_checkpoint_info(module: nn.Module) -> dict:
    """DeepSpeed's `universal_checkpoint_info` for an AutoTP-sharded `module` (its engine stores it on the model
    and in every model-states file), by `^name$` patterns of each parameter's first name:

    - row-parallel: weights split along dim 1, which DeepSpeed's converter joins there (row-parallel layers'
      weights, and column-parallel ones of a transposed `Conv1D`);
    - tp-replicated: parameters AutoTP left whole (norms, embeddings, row-parallel biases);
    - sub-params: fused column layers (`[q; k; v]`, `[gate; up]`), with each part's full size at the split
      dimension (`{"patterns", "shape", "partition_dim"}`), and each rank's width of each part
      (`sub_param_shard_widths`, which DeepSpeed's converter requires from version 0.4);
    - vocabulary: the vocabulary-split embedding / LM head, or a column LM head, with the vocabulary size.

    Layers publish what their parameters' metadata says (module_inject/tp_uc_meta.py: the conversion view);
    shardspeed's own loader does not need this (the files record each parameter's `TPPartition`); it is what
    DeepSpeed's converter and loader read. Every layout AutoTP makes is mergeable, so nothing is unsupported.
    """
    first_name = {id(p): n for n, p in module.named_parameters()}
    info = {_VERSION: 0.4, _ROW: [], _REPLICATED: [], _VOCAB: [], _SUB_PARAMS: [], _UNSUPPORTED: {}}
    widths = {}
    for module_name, owner in module.named_modules():
        refresh = getattr(owner, "_mark_uc_metadata", None)
        if refresh is not None:
            refresh()  # the layer's current layout (sizes frozen at build time, shapes as they are now)
        for local, param in owner.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            if first_name.get(id(param)) != name:
                continue  # a tied alias: the checkpoint knows the parameter by its first name only
            pattern = rf"^{re.escape(name)}$"
            part = getattr(param, "tp_partition", None)
            conversion = param_uc_conversion_meta(param)
            if part is None and conversion is None:
                info[_REPLICATED].append(pattern)
                continue
            if conversion is not None:
                if conversion.get("unsupported_reason"):
                    info[_UNSUPPORTED][pattern] = conversion["unsupported_reason"]
                    continue
                _publish_conversion(info, widths, pattern, conversion)
            else:  # the vocabulary-parallel layers: described by their partition alone
                if len(part.segments) > 1:
                    raise ValueError(f"{name}: a fused vocabulary-parallel parameter has no universal layout")
            is_head = isinstance(owner, LinearLayer) and module_name.rpartition(".")[2] in _LM_HEAD_NAMES
            if local == "weight" and (
                isinstance(owner, (VocabParallelEmbedding, VocabParallelLMHead)) or is_head
            ):
                info[_VOCAB].append(pattern)
                info.setdefault(_VOCAB_SIZE, part.segments[0] if part is not None else param.shape[0])
    if widths:
        info[_WIDTHS] = widths
    for key in (_ROW, _REPLICATED, _VOCAB):
        info[key] = sorted(info[key])
    return info
