"""The inference config: DeepSpeed's ``init_inference`` keys as typed blocks (``InferenceConfig``).

    cfg = load_inference_config({"dtype": "fp16", "tensor_parallel": {"tp_size": 2}}, {"max_out_tokens": 256})

``config`` may be None, a dict or a JSON file path; keyword arguments are merged in, and a key given in both
with different values is an error naming it (as DeepSpeed). Process groups and ``mpu`` objects are not JSON:
they are taken out before the typed build and put back on the result. DeepSpeed keys that only make sense
for its compiled kernels (``use_triton``, ``triangular_masking``, ...) are accepted and have no effect here;
``replace_with_kernel_inject`` is accepted and the engine logs what replaces it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch

from .blocks import PositiveInt
from .build import BuildContext, Key, build_block, join, show
from .errors import ConfigError

__all__ = [
    "InferenceCheckpointConfig",
    "InferenceConfig",
    "InferenceTensorParallelConfig",
    "load_inference_config",
]

_INFERENCE_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
_DTYPE_SPELLINGS = {
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "torch.int8": "int8",
}


def _inference_dtype_name(value: Any) -> Any:
    """torch.float16, "float16", "FP16" -> "fp16" (DeepSpeed accepts a torch dtype or its names)."""
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str):
        lowered = value.lower()
        return _DTYPE_SPELLINGS.get(lowered, lowered)
    return value


InferenceDtypeName = Annotated[Literal["fp32", "fp16", "bf16", "int8"], Key(normalize=_inference_dtype_name)]


@dataclass(kw_only=True)
class InferenceTensorParallelConfig:
    """``tensor_parallel`` (alias ``tp``): how many ranks split each layer."""

    enabled: bool = True
    """Use tensor parallelism when tp_size > 1. Default true."""
    tp_size: PositiveInt = 1
    """Ranks each layer is split over (heads and MLP columns/rows). Default 1."""
    tp_grain_size: PositiveInt = 64
    """DeepSpeed's granularity of uneven splits; accepted, splits here are by whole heads. Default 64."""
    tp_group: Annotated[Any, Key(internal=True)] = None
    """The process group to split over (not JSON: passed as a Python object). Default: built from the world."""
    mpu: Annotated[Any, Key(internal=True)] = None
    """A Megatron-style mpu whose model-parallel group is used (not JSON). Default null."""


@dataclass(kw_only=True)
class InferenceCheckpointConfig:
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    checkpoint_dir: str | None = None
    """Directory of a checkpoint to load. Default null."""
    save_mp_checkpoint_path: str | None = None
    """Not supported: set it and the engine refuses. Default null."""
    base_dir: str | None = None
    """Directory the checkpoint's file names are relative to. Default null."""


@dataclass(kw_only=True)
class InferenceConfig:
    """DeepSpeed's ``DeepSpeedInferenceConfig``: the arguments of ``init_inference``."""

    dtype: InferenceDtypeName = "fp16"
    """Weights' dtype: fp32, fp16, bf16, or int8 (weight-only 8-bit quantization of linear layers). Default fp16."""
    tensor_parallel: Annotated[InferenceTensorParallelConfig, Key(synonyms=("tp",))] = field(
        default_factory=InferenceTensorParallelConfig
    )
    """Tensor-parallel degree and group."""
    replace_with_kernel_inject: Annotated[bool, Key(synonyms=("kernel_inject",))] = False
    """DeepSpeed's compiled kernels; accepted, the engine's SDPA + KV-cache decode path is used instead."""
    enable_cuda_graph: bool = False
    """Capture the single-token decode step in a CUDA graph (CUDA only; ignored with a note on CPU)."""
    injection_policy: Annotated[dict[Any, Any] | None, Key(synonyms=("injection_dict",))] = None
    """{module class or name: (names of linears whose output is all-reduced, ...)}: a user's sharding hints."""
    checkpoint: str | dict[str, Any] | None = None
    """A checkpoint to load: a directory or file of safetensors/torch weights, or a DeepSpeed checkpoint json."""
    base_dir: str = ""
    """Directory the checkpoint's file names are relative to. Default ""."""
    checkpoint_config: Annotated[InferenceCheckpointConfig, Key(synonyms=("ckpt_config",))] = field(
        default_factory=InferenceCheckpointConfig
    )
    """Checkpoint directories (DeepSpeed's newer spelling)."""
    max_out_tokens: Annotated[int, Key(gt=0, synonyms=("max_tokens",))] = 1024
    """Longest sequence (prompt + generated) the preallocated KV cache holds. Default 1024."""
    min_out_tokens: Annotated[int, Key(ge=1, synonyms=("min_tokens",))] = 1
    """DeepSpeed's kernel workspace hint; accepted. Default 1."""
    return_tuple: bool = True
    """Accepted for compatibility (outputs are the model's own). Default true."""
    keep_module_on_host: bool = False
    """Keep the module on the CPU instead of moving it to the accelerator. Default false."""
    zero: dict[str, Any] = field(default_factory=dict)
    """ZeRO-Inference; not supported: a non-empty block is refused."""
    moe: bool | dict[str, Any] = field(default_factory=dict)
    """Expert-parallel inference; not supported: an enabled block is refused."""
    quant: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's quantization block; int8 weights are chosen with dtype int8 here."""
    training_mp_size: PositiveInt = 1
    """Tensor-parallel degree the checkpoint was trained with; accepted. Default 1."""
    replace_method: str = "auto"
    """Accepted for compatibility. Default "auto"."""
    use_triton: bool = False
    """DeepSpeed's Triton kernels; accepted, no effect. Default false."""
    triton_autotune: bool = False
    """Accepted, no effect. Default false."""
    triangular_masking: Annotated[bool, Key(synonyms=("tm",))] = True
    """Accepted, no effect (attention is always causal for causal LMs). Default true."""
    set_empty_params: bool = False
    """Accepted, no effect. Default false."""
    transposed_mode: bool = False
    """Accepted, no effect. Default false."""
    save_mp_checkpoint_path: str | None = None
    """Not supported: saving the sharded model is refused."""
    mp_size: Annotated[int | None, Key(gt=0)] = None
    """Deprecated: tensor_parallel.tp_size."""

    def validate(self, path: str) -> None:
        if self.mp_size is not None:
            tp = self.tensor_parallel
            if tp.tp_size not in (1, self.mp_size):
                raise ConfigError(
                    f"{join(path, 'mp_size')}: {self.mp_size} contradicts tensor_parallel.tp_size = "
                    f"{tp.tp_size}; mp_size is the old name of tensor_parallel.tp_size, give only one"
                )
            tp.tp_size = self.mp_size
        if self.zero:
            raise ConfigError(f"{join(path, 'zero')}: ZeRO-Inference is not supported by shardspeed")
        moe_on = self.moe is True or (isinstance(self.moe, dict) and self.moe.get("enabled", bool(self.moe)))
        if moe_on:
            raise ConfigError(
                f"{join(path, 'moe')}: expert-parallel inference is not supported by shardspeed"
            )
        for key in ("save_mp_checkpoint_path",):
            if getattr(self, key) or getattr(self.checkpoint_config, key):
                raise ConfigError(f"{join(path, key)}: saving a tensor-parallel checkpoint is not supported")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weights' dtype (int8 means: fp32/fp16 compute over int8 weights)."""
        return _INFERENCE_DTYPES[self.dtype]

    @property
    def tp_size(self) -> int:
        tp = self.tensor_parallel
        return tp.tp_size if tp.enabled else 1


_NOT_JSON = ("tp_group", "mpu")


def _read_source(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, str | os.PathLike):
        with open(config) as handle:
            return json.load(handle)
    if isinstance(config, dict):
        return dict(config)
    raise ConfigError(f"config: expected None, a dict or a JSON file path, got {type(config).__name__}")


def load_inference_config(config: Any = None, kwargs: dict | None = None) -> InferenceConfig:
    """Merge ``config`` and ``kwargs`` (conflicting values are an error) and build the typed config."""
    data = _read_source(config)
    for key, value in (kwargs or {}).items():
        if key in data and data[key] != value:
            raise ConfigError(
                f"{key}: given in config as {show(data[key])} and as keyword argument {show(value)}; give one"
            )
        data[key] = value
    # Objects that are not JSON values ride outside the typed build.
    objects: dict[str, Any] = {}
    tp_key = "tensor_parallel" if "tensor_parallel" in data else "tp"
    tp_block = data.get(tp_key)
    if isinstance(tp_block, dict):
        tp_block = dict(tp_block)
        for name in _NOT_JSON:
            if name in tp_block:
                objects[name] = tp_block.pop(name)
        data[tp_key] = tp_block
    if "mpu" in data:
        objects["mpu"] = data.pop("mpu")
    if isinstance(data.get("dtype"), torch.dtype):
        data["dtype"] = _inference_dtype_name(data["dtype"])
    result = build_block(InferenceConfig, data, "", BuildContext())
    for name, value in objects.items():
        setattr(result.tensor_parallel, name, value)
    return result
