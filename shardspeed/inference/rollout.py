"""Generation from a model that is being trained: the hybrid engine's ``generate`` (DeepSpeed-Chat's rollouts).

``RolloutGenerator.generate`` takes Hugging Face ``generate``'s arguments and returns what it returns, like
``InferenceEngine.generate``, with three differences that come from the model belonging to a training engine:

* The weights are made whole once per call by a context the engine hands in (``gathered``: under ZeRO-3 it
  gathers every parameter unit and pauses the per-module hooks; at stages 0-2 it does nothing), and the
  whole call, prefill and every token, runs inside it. Token-by-token generation through the model's own
  forward would gather each layer again for every token.
* The model's parameters are left exactly as they are, because the optimizer and ZeRO hold them by identity:
  the decoder runs q/k/v and gate/up each as one matmul from fused *copies* of those weights
  (``FastDecoder(fuse=False, fuse_copies=True)``), made inside the gather at the start of the call and
  dropped when it returns. So the call holds, besides the gathered model, one more copy of those weights
  (about two thirds of a Llama layer's) and nothing survives it; the next call copies the weights as they
  are then, so generation after an optimizer step sees the updated model. Separate matmuls would cost
  each decode step three launches where one does (the unsharded fast path fuses the same way).
* LoRA linears (DeepSpeed-Chat's ``LinearLayer_LoRA`` layout) run fused for the call, from fused copies of
  their weights (lora.py): one matmul per linear, the base weights never written.
* The KV cache is sized by ``max_out_tokens`` (prompt and new tokens, DeepSpeed's meaning) and, unless
  ``release_inference_cache``, kept for the next call of the same batch size instead of re-allocated.

``per_layer`` (ZeRO-3 with ``pin_parameters`` false) gives up the single gather for memory: the model's own
``generate`` runs with the ZeRO-3 hooks on, gathering one layer at a time for every token, as DeepSpeed does
without pinned parameters (LoRA linears then run their own, unfused forward: their weights are whole only
inside it). Arguments our loop does not implement (beam search, logits processors, ...) go to
the model's own ``generate``, inside the same single gather, so the answer is always the model's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn

from .decoder import FastDecoder, ModelDecoder
from .generation import GenerationSettings, generate_tokens
from .lora import fused_lora
from .tp_rollout import TensorParallelSplit

__all__ = ["RolloutGenerator"]

logger = logging.getLogger(__name__)


class RolloutGenerator:
    """``generate`` for a training engine's module (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        max_out_tokens: int,
        release_cache: bool,
        model_generate: Callable | None,
        gathered: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        per_layer: bool = False,
        tensor_parallel: TensorParallelSplit | None = None,
    ):
        self.module = module
        self.max_out_tokens = max_out_tokens
        self.release_cache = release_cache
        self.model_generate = model_generate  # the model's own generate, bound (before anyone replaced it)
        self.gathered = gathered
        self.per_layer = per_layer
        self.tensor_parallel = (
            tensor_parallel  # inference_tp_size > 1: decode on this rank's shards (tp_rollout.py)
        )
        self.cache = None  # the StaticKVCache kept between calls (release_cache false, fast path only)
        self.calls = 0
        self.last_gather_seconds = 0.0  # making the weights whole (DeepSpeed's "Gather latency")
        self.last_generate_seconds = 0.0  # prefill and decode, after the gather
        self.last_lora_fused = 0  # LoRA linears run fused during the last call (lora.py)
        # Bytes of weights the last call's decode held on this rank: "whole" (model parameters read whole),
        # "shards" (tensor-parallel shards), "copies" (fused or whole copies the decoder made)
        self.weight_bytes: dict[str, int] = {}

    def generate(self, inputs=None, **kwargs):
        input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
        if input_ids is None:
            raise ValueError("generate: input_ids (or the first positional argument) is required")
        settings = GenerationSettings.resolve(self.module, input_ids.shape[-1], kwargs)
        self._check_length(input_ids.shape[-1], settings.max_new_tokens)
        self.calls += 1
        start = time.perf_counter()
        if self.per_layer:  # hooks on: every rank must run every token's gathers, so keep them in step
            kwargs.setdefault("synced_gpus", dist.is_initialized() and dist.get_world_size() > 1)
            self.last_gather_seconds = 0.0
            result = self._model_generate(input_ids, kwargs)
            self.last_generate_seconds = time.perf_counter() - start
            return result
        if self.tensor_parallel is not None:
            return self._generate_tensor_parallel(input_ids, kwargs, settings, start)
        with self.gathered(), fused_lora(self.module) as fused:
            gathered_at = time.perf_counter()
            self.last_gather_seconds = gathered_at - start
            self.last_lora_fused = len(fused)
            result = self._generate_gathered(input_ids, kwargs, settings, fused)
        self.last_generate_seconds = time.perf_counter() - gathered_at
        return result

    def _generate_gathered(self, input_ids, kwargs: dict, settings: GenerationSettings, lora_copies=()):
        # Decoding with the weights whole runs no collective, so ranks need nothing to stay in step:
        # `synced_gpus` (DeepSpeed-Chat passes it under ZeRO-3) is already what happens.
        synced = kwargs.pop("synced_gpus", None)
        unhandled = GenerationSettings.unhandled(self.module, kwargs)
        if unhandled:
            logger.info(
                "generate: %s not handled by the decode loop; using the model's own generate", unhandled
            )
            if synced is not None:
                kwargs["synced_gpus"] = synced
            return self._model_generate(input_ids, kwargs)
        device = next(self.module.parameters()).device
        input_ids = input_ids.to(device)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            mask = mask.to(device)
            if bool(mask.all()):  # unpadded: the prompt's attention takes the causal kernel
                mask = None
        decoder = self._decoder()
        self.weight_bytes = {
            "whole": _nbytes(self.module.parameters()),
            "shards": 0,
            "copies": _copies(decoder) + _nbytes(lora_copies),  # fused q/k/v, gate/up; fused LoRA weights
        }
        try:
            tokens = generate_tokens(decoder, input_ids, mask, settings, self.max_out_tokens)
            # a copy made outside inference mode: rollouts are trained on next (an inference tensor cannot be
            # saved for backward), as Hugging Face's generate, which runs under no_grad, allows
            return tokens.clone()
        finally:
            self._keep_or_release(decoder)

    def _generate_tensor_parallel(self, input_ids, kwargs: dict, settings: GenerationSettings, start: float):
        kwargs.pop("synced_gpus", None)  # the group's ranks decode in step by construction
        unhandled = GenerationSettings.unhandled(self.module, kwargs)
        if unhandled:
            raise ValueError(
                f"generate: {unhandled} not handled by the decode loop, which hybrid_engine.inference_tp_size > 1 "
                "needs (the model's own generate would need the whole model); set inference_tp_size 1 for them"
            )
        split, batch = self.tensor_parallel, input_ids.shape[0]
        device = next(self.module.parameters()).device
        mask = kwargs.get("attention_mask")
        with split.split() as parts:
            gathered_at = time.perf_counter()
            self.last_gather_seconds = gathered_at - start
            ids, mask = split.gather_inputs(
                input_ids.to(device), mask.to(device) if mask is not None else None
            )
            decoder = FastDecoder(self.module, parts=parts)
            decoder.cache, decoder.keep_cache = self.cache, not self.release_cache
            try:
                tokens = generate_tokens(
                    decoder, ids, None if bool(mask.all()) else mask, settings, self.max_out_tokens
                )
            finally:
                self._keep_or_release(decoder)
        self.weight_bytes = {k: split.held[k] for k in ("whole", "shards", "copies")}
        self.last_generate_seconds = time.perf_counter() - gathered_at
        return split.own_rows(tokens, batch).clone()

    def _decoder(self):
        """A decoder over the module as it is now (built per call: cheap, and never stale after a step)."""
        if not FastDecoder.supports(self.module, self.max_out_tokens):
            return ModelDecoder(self.module)
        decoder = FastDecoder(self.module, fuse=False, fuse_copies=True)
        decoder.cache, decoder.keep_cache = self.cache, not self.release_cache
        return decoder

    def _keep_or_release(self, decoder) -> None:
        self.cache = getattr(decoder, "cache", None) if not self.release_cache else None
        if self.release_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the cache's memory back to training, as DeepSpeed does

    def _model_generate(self, input_ids, kwargs: dict):
        if self.model_generate is None:
            raise TypeError(
                f"generate: {type(self.module).__name__} has no generate() of its own to run these arguments"
            )
        with torch.no_grad():
            return self.model_generate(input_ids, **kwargs)

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len + max_new_tokens > self.max_out_tokens:
            raise ValueError(
                f"hybrid_engine.max_out_tokens: the prompt ({prompt_len} tokens) and max_new_tokens "
                f"({max_new_tokens}) exceed it ({self.max_out_tokens}); raise it in the config or generate less"
            )

    def release(self) -> None:
        """Drop the kept KV cache (the engine's destroy())."""
        self.cache = None


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values() if t is not None)


def _copies(decoder) -> int:
    """Bytes of the fused weight copies a ``FastDecoder`` made for the call (none for ``ModelDecoder``)."""
    fused = [
        f for f in getattr(decoder, "qkv", []) + getattr(decoder, "gate_up", []) if f is not None and f.copy
    ]
    return _nbytes([t for f in fused for t in (f.weight, f.bias)])
