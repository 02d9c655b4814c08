"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` names, for code that imports or patches them.

Transformers' `prevent_arange_dtype_change` swaps `zero_wrapper_for_fp_tensor_constructor` around model
construction so that `zero.Init` does not cast `torch.arange` results (RoPE tables) to the training dtype.
shardspeed's `zero.Init` never wraps tensor constructors (it casts parameters when it partitions them), so
the wrapper here is only what such code reads and restores: it returns the constructor unchanged apart from
the device. `ZeroParamStatus` (a parameter's `ds_status`) and `ZeroParamType` let code ask about a
parameter's state the DeepSpeed way; they are defined with zero.Init (zero/init.py).
"""

from __future__ import annotations

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.core.partitioned import ZeroParamStatus, ZeroParamType, is_partitioned
from shardspeed.zero import GatheredParameters, Init

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "get_accelerator",
    "is_zero_param",
    "partitioned_param_data_shape",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """`fn` with `device` defaulting to `target_device`; dtypes are left alone (see the module docstring)."""

    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        return fn(*args, **kwargs)

    return wrapped


def is_zero_param(parameter) -> bool:
    """True for a parameter partitioned by `zero.Init` or managed by a ZeRO-3 engine."""
    return is_partitioned(parameter) or getattr(parameter, "_shardspeed_unit", None) is not None


# The shape of a partitioned parameter's `.data` outside a gather (its values live in the shard).
partitioned_param_data_shape = [0]
