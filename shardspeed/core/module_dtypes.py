"""The module's dtypes at engine start (`data_types`: `param_dtype`, `buffer_dtype`, `keep_in_fp32_modules`).

As DeepSpeed 0.19: parameters take the training dtype (fp16/bf16 block, else they stay as they are);
floating buffers keep the dtype they were loaded in (an fp32 rotary table stays fp32 under bf16) unless
`buffer_dtype` names one; and the buffers `keep_in_fp32_modules` selects stay, or become, fp32 under fp16/bf16
training. "auto" selects what the model's own Hugging Face lists name (`_keep_in_fp32_modules_strict`, and
`_keep_in_fp32_modules` under fp16); a list gives name patterns where `*` matches anything and a pattern may
match anywhere in a buffer's full name (the rule transformers uses); [] selects nothing.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardspeed.core.precision import DTYPES

__all__ = ["cast_module", "keep_in_fp32_pattern"]


def keep_in_fp32_pattern(module: nn.Module, setting, dtype: torch.dtype) -> re.Pattern | None:
    """The compiled pattern of buffer names to keep in fp32 under training dtype `dtype`, or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None  # fp32 training keeps everything in fp32 anyway
    if setting == "auto":
        patterns = set()
        for prefix, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(prefix)}\..*{pattern}" if prefix else pattern)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def cast_module(module: nn.Module, param_dtype: torch.dtype, data_types) -> None:
    """Cast `module` in place: parameters to `param_dtype`, buffers per `data_types` (see the docstring)."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != param_dtype:
            p.data = p.data.to(param_dtype)
    keep = keep_in_fp32_pattern(module, data_types.keep_in_fp32_modules, param_dtype)
    buffer_dtype = DTYPES[data_types.buffer_dtype] if data_types.buffer_dtype is not None else None
    for name, owner, buf in _named_floating_buffers(module):
        if keep is not None and keep.search(name):
            target = torch.float32
        elif buffer_dtype is not None:
            target = buffer_dtype
        else:
            continue
        if buf.dtype != target:
            owner._buffers[name.rpartition(".")[2]] = buf.to(target)


def _named_floating_buffers(module: nn.Module):
    for prefix, owner in module.named_modules():
        for short, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                yield (f"{prefix}.{short}" if prefix else short), owner, buf
