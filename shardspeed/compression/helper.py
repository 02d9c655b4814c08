"""DeepSpeed's ``deepspeed.compression.helper``: module lookup by dotted name, layer replacement, cleaning one
module, and GPT-2's ``Conv1D`` to ``nn.Linear``.

``recursive_getattr`` / ``recursive_setattr`` are what DeepSpeed-Chat's LoRA code imports.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import constants as C
from .basic_layer import (
    BNLayer_Compress,
    ColumnParallelLinear_Compress,
    Conv2dLayer_Compress,
    Embedding_Compress,
    LinearLayer_Compress,
    RowParallelLinear_Compress,
)
from .compressible import Compressible

__all__ = [
    "compression_preparation",
    "convert_conv1d_to_linear",
    "fix_compression",
    "is_module_compressible",
    "module_replacement",
    "recursive_getattr",
    "recursive_setattr",
]

_COMPRESSED = (LinearLayer_Compress, Conv2dLayer_Compress, Embedding_Compress, BNLayer_Compress)


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """``model.a.b.c`` from ``"a.b.c"`` (list indices are names too: ``"layers.3"``)."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` from ``"a.b.c"``."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)


def _mpu_classes(mpu) -> tuple[type, ...]:
    return tuple(
        getattr(mpu, name) for name in ("ColumnParallelLinear", "RowParallelLinear") if hasattr(mpu, name)
    )


def is_module_compressible(module: nn.Module, mpu=None) -> bool:
    """Linear, Conv2d, Embedding, BatchNorm2d, an mpu's parallel linears, and compression layers (AutoTP's
    tensor-parallel ones included)."""
    kinds = (nn.Linear, nn.Conv2d, nn.Embedding, nn.BatchNorm2d, Compressible)
    kinds += _mpu_classes(mpu) if mpu is not None else ()
    return isinstance(module, kinds)


def _compressed_twin(old: nn.Module, mpu) -> nn.Module | None:
    if isinstance(old, _COMPRESSED):
        return old
    mpu_classes = _mpu_classes(mpu) if mpu is not None else ()
    if mpu_classes and isinstance(old, mpu_classes):
        return _mpu_twin(old, mpu)
    for kind, twin in ((nn.Linear, LinearLayer_Compress), (nn.Conv2d, Conv2dLayer_Compress),
                       (nn.Embedding, Embedding_Compress), (nn.BatchNorm2d, BNLayer_Compress)):  # fmt: skip
        if isinstance(old, kind):
            return twin.from_module(old)
    return None


def _mpu_twin(old: nn.Module, mpu) -> nn.Module:
    if isinstance(old, (ColumnParallelLinear_Compress, RowParallelLinear_Compress)):
        return old
    has_bias = getattr(old, "bias", None) is not None
    if type(old).__name__.startswith("Column"):
        new = ColumnParallelLinear_Compress(mpu, old.input_size, old.output_size, bias=has_bias,
                                            gather_output=old.gather_output, skip_bias_add=old.skip_bias_add)  # fmt: skip
    else:
        new = RowParallelLinear_Compress(mpu, old.input_size, old.output_size, bias=has_bias,
                                         input_is_parallel=old.input_is_parallel, skip_bias_add=old.skip_bias_add)  # fmt: skip
    new.weight = old.weight
    if has_bias:
        new.bias = old.bias
    return new.to(old.weight.device)


def module_replacement(model: nn.Module, module_name: str, compression_technique=None, mpu=None) -> None:
    """Replace ``module_name`` by its compressed twin and enable ``compression_technique`` on it
    (``{technique: parameters}``, the group's params merged with the technique's shared parameters)."""
    new = _compressed_twin(recursive_getattr(model, module_name), mpu)
    if new is None:
        return
    for technique, params in (compression_technique or {}).items():
        _enable(new, technique, params)
    recursive_setattr(model, module_name, new)


def _enable(module: nn.Module, technique: str, p: dict) -> None:
    if not p.get(C.TECHNIQUE_ENABLED, False):
        return
    if technique == C.WEIGHT_QUANTIZATION:
        module.enable_weight_quantization(
            p[C.WEIGHT_QUANTIZE_START_BITS], p[C.WEIGHT_QUANTIZE_TARGET_BITS], p[C.WEIGHT_QUANTIZATION_PERIOD],
            p[C.WEIGHT_QUANTIZE_IN_FORWARD_ENABLED], p[C.WEIGHT_QUANTIZE_TYPE], p[C.WEIGHT_QUANTIZE_GROUPS],
            rounding=p[C.WEIGHT_QUANTIZE_ROUNDING], fp16_mixed=p[C.WEIGHT_QUANTIZE_FP16_MIXED_QUANTIZE],
            verbose=p[C.WEIGHT_QUANTIZE_VERBOSE],
        )  # fmt: skip
    elif technique == C.ACTIVATION_QUANTIZATION:
        module.enable_activation_quantization(
            p[C.ACTIVATION_QUANTIZE_BITS], p[C.ACTIVATION_QUANTIZE_TYPE], p[C.ACTIVATION_QUANTIZE_RANGE]
        )
    elif technique == C.HEAD_PRUNING:
        module.enable_head_pruning(
            p[C.HEAD_PRUNING_DENSE_RATIO], p[C.HEAD_PRUNING_METHOD], p[C.HEAD_PRUNING_NUM_HEADS]
        )
    elif technique in (C.SPARSE_PRUNING, C.ROW_PRUNING, C.CHANNEL_PRUNING):
        enable = getattr(module, f"enable_{technique}", None)
        if enable is None:
            raise ValueError(f"{technique}: {type(module).__name__} layers do not support it")
        enable(p["dense_ratio"], p["method"])
    else:
        raise ValueError(f"compression technique {technique!r} is not one of {C.TECHNIQUE_NAMES}")


def compression_preparation(model: nn.Module, compression_technique_list, mpu) -> nn.Module:
    """Swap every compressible module for its compressed twin, then enable each group's technique on its
    modules (``[[module names per pattern], related names, {technique: params}]`` items)."""
    for name, module in list(model.named_modules()):
        if name and is_module_compressible(module, mpu):
            module_replacement(model, name, mpu=mpu)
    for module_name_lists, _, technique in compression_technique_list:
        for names in module_name_lists:
            for name in names:
                module_replacement(model, name, technique, mpu=mpu)
    return model


def fix_compression(
    model: nn.Module, module_name: str, compression_technique: dict, mask=None, dim_reduction=False
):
    """Make ``compression_technique`` permanent on one module (DeepSpeed's dispatch); returns a pruning mask
    for the related modules, or None."""
    module = recursive_getattr(model, module_name)
    for technique, p in compression_technique.items():
        enabled = p.get(C.TECHNIQUE_ENABLED, False)
        if technique == C.WEIGHT_QUANTIZATION and enabled:
            return module.fix_weight_quantization()
        if technique == C.SPARSE_PRUNING and enabled:
            return module.fix_sparse_pruning_helper()
        if technique == C.ROW_PRUNING and (enabled or mask is not None):
            return module.fix_row_col_pruning_helper(mask, dim_reduction=dim_reduction)
        if technique == C.HEAD_PRUNING and (enabled or mask is not None):
            return module.fix_head_pruning_helper(
                mask, p.get(C.HEAD_PRUNING_NUM_HEADS), dim_reduction=dim_reduction
            )
        if technique == C.CHANNEL_PRUNING and (enabled or mask is not None):
            return module.fix_channel_pruning_helper(mask, dim_reduction=dim_reduction)
    return None


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace every ``convert_type`` (Hugging Face's ``Conv1D``: weight [in, out]) by an equal ``nn.Linear``."""
    inner = model.module if hasattr(model, "module") else model
    for name, module in list(inner.named_modules()):
        if not isinstance(module, convert_type):
            continue
        weight = module.weight.detach()
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=module.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.t().contiguous(), requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            linear.bias = nn.Parameter(
                module.bias.detach().reshape(-1).clone(), requires_grad=module.bias.requires_grad
            )
        recursive_setattr(inner, name, linear.to(torch.device(weight.device)))
    return model
