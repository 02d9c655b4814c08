"""``InferenceEngine``: a model prepared for serving — split over a tensor group, cast, loaded, fast decode.

Built by ``init_inference`` in this order (each step a small function, see below):
  1. the tensor-parallel group: ``tensor_parallel.tp_group``, an ``mpu``'s model-parallel group, or a
     ``ParallelGrid`` ("data" x "model") over the world when only ``tp_size`` is given;
  2. the split: module_inject's ``shard_model`` (the same column/row layers training uses), guided by the
     user's ``injection_policy`` where given;
  3. weights from ``checkpoint`` files, one tensor at a time (loading.py), into a meta-device model too;
  4. dtype (int8 = weight-only quantization, quantize.py) and device;
  5. the decode path (decoder.py) that ``generate`` runs.
The engine's call is the model's forward; ``.module`` is the model.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.config.inference import InferenceConfig

from .decoder import make_decoder
from .generation import GenerationSettings, generate_tokens
from .loading import checkpoint_files, load_weights, prepare_packed
from .quantize import quantize_linears_int8

__all__ = ["InferenceEngine"]

logger = logging.getLogger(__name__)


def _tensor_group(config: InferenceConfig):
    """The process group the model is split over (None when tp_size is 1)."""
    tp = config.tensor_parallel
    tp_size = config.tp_size
    if tp.tp_group is not None:
        return tp.tp_group
    if tp.mpu is not None:
        return tp.mpu.get_model_parallel_group()
    if tp_size == 1:
        return None
    if not dist.is_initialized():
        from shardspeed.comm.init import init_distributed

        init_distributed()
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tensor_parallel.tp_size: {tp_size} does not divide the world size {world}")
    from shardspeed.comm.topology import ParallelGrid, ProcessTopology

    grid = ParallelGrid(ProcessTopology(["data", "model"], [world // tp_size, tp_size]))
    return grid.get_model_parallel_group()


def policy_to_layer_specs(model: nn.Module, policy: dict) -> list[dict]:
    """DeepSpeed's ``injection_policy`` ({block class: (names of output linears, ...)}) as layer specs.

    Inside every module of a named class, the linears named in the tuple are row-parallel (their outputs
    are all-reduced) and every other linear is column-parallel — DeepSpeed's meaning of the policy.
    """
    specs = []
    for block_type, row_names in policy.items():
        names = (row_names,) if isinstance(row_names, str) else tuple(row_names)
        matched = False
        for block_name, block in model.named_modules():
            if not (block_type is type(block) or block_type == type(block).__name__):
                continue
            matched = True
            for child_name, child in block.named_modules():
                if not isinstance(child, nn.Linear) or not child_name:
                    continue
                kind = "row" if child_name in names or child_name.split(".")[-1] in names else "column"
                full = f"{block_name}.{child_name}" if block_name else child_name
                specs.append({"patterns": [f"^{full.replace('.', '[.]')}$"], "partition_type": kind})
        if not matched:
            raise ValueError(f"injection_policy: no module of type {block_type!r} in the model")
    return specs


def _materialize_meta_buffers(model: nn.Module) -> None:
    """Rebuild modules whose non-persistent buffers (rotary tables) are still on the meta device."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"checkpoint: buffer of {name or 'the model'} was not in the checkpoint")
        fresh = type(module)(config=config)
        for key, buffer in fresh.named_buffers(recurse=False):
            module._buffers[key] = buffer


class InferenceEngine(nn.Module):
    """DeepSpeed's ``InferenceEngine``: call = the model's forward, ``generate`` = our decode loop."""

    def __init__(self, model: nn.Module, config: InferenceConfig):
        super().__init__()
        self._config = config
        self.module = model
        self.mp_group = _tensor_group(config)
        self.tp_rank = dist.get_rank(self.mp_group) if self.mp_group is not None else 0
        self.tp_report = None
        if config.replace_with_kernel_inject:
            logger.info(
                "replace_with_kernel_inject: shardspeed compiles no kernels; the model keeps its own "
                "modules and generates through scaled_dot_product_attention with a preallocated KV cache"
            )
        if self.mp_group is not None and dist.get_world_size(self.mp_group) > 1:
            self._shard(model)
        device = self._target_device()
        compute_dtype = torch.float32 if config.dtype == "int8" else config.torch_dtype
        if config.checkpoint is not None or config.checkpoint_config.checkpoint_dir:
            self._load(model, compute_dtype, device)
        elif any(p.is_meta for p in model.parameters()):
            raise ValueError(
                "checkpoint: the model is on the meta device; give checkpoint= to load its weights"
            )
        model.to(device=device, dtype=compute_dtype)
        if config.dtype == "int8":
            quantize_linears_int8(model)
        model.eval()
        self._decoder = make_decoder(model, config.max_out_tokens)
        if config.enable_cuda_graph and device.type != "cuda":
            logger.info("enable_cuda_graph: ignored on %s (CUDA graphs need a CUDA device)", device.type)

    # ---- construction steps ------------------------------------------------------------------------
    def _shard(self, model: nn.Module) -> None:
        from shardspeed.module_inject.auto_tp import shard_model

        policy = self._config.injection_policy
        specs = policy_to_layer_specs(model, policy) if policy else None
        self.tp_report = shard_model(model, self.mp_group, layer_specs=specs, use_default_specs=not policy)
        logger.info(self.tp_report.summary())

    def _target_device(self) -> torch.device:
        if self._config.keep_module_on_host:
            return torch.device("cpu")
        from shardspeed.accelerator import get_accelerator

        return torch.device(get_accelerator().current_device_name())

    def _load(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        cfg = self._config
        source = cfg.checkpoint if cfg.checkpoint is not None else cfg.checkpoint_config.checkpoint_dir
        base = cfg.base_dir or cfg.checkpoint_config.base_dir or ""
        files = checkpoint_files(source, base)
        aliases = prepare_packed(model, files, self._config.tp_size)  # compressed checkpoints: packed layers
        load_weights(model, files, rank=self.tp_rank, dtype=dtype, device=device, aliases=aliases)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        _materialize_meta_buffers(model)
        missing = [name for name, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(
                f"checkpoint: no weights for {missing[:5]} ({len(missing)} parameters) in {files}"
            )

    # ---- use ---------------------------------------------------------------------------------------
    @property
    def config(self) -> InferenceConfig:
        return self._config

    @property
    def decoder(self):
        """The decode path ``generate`` uses (FastDecoder for Llama-style models, else ModelDecoder)."""
        return self._decoder

    def forward(self, *args, **kwargs):
        with torch.inference_mode():
            return self.module(*args, **kwargs)

    def generate(self, inputs=None, **kwargs):
        """Hugging Face ``generate``'s arguments and result, through the engine's decode loop.

        Options the loop does not implement (beam search, logits processors, dict outputs, ...) go to the
        model's own ``generate`` unchanged, so the answer is always the model's.
        """
        input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
        if input_ids is None:
            raise ValueError("generate: input_ids (or the first positional argument) is required")
        unhandled = GenerationSettings.unhandled(self.module, kwargs)
        if unhandled:
            logger.info(
                "generate: %s not handled by the fast path; using the model's own generate", unhandled
            )
            with torch.inference_mode():
                return self.module.generate(input_ids, **kwargs)
        device = self._decoder_device()
        input_ids = input_ids.to(device)
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
            if bool(attention_mask.all()):
                attention_mask = None
        settings = GenerationSettings.resolve(self.module, input_ids.shape[1], kwargs)
        return generate_tokens(
            self._decoder, input_ids, attention_mask, settings, self._config.max_out_tokens
        )

    def _decoder_device(self) -> torch.device:
        return next(self.module.parameters()).device
