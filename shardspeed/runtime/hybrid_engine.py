"""The hybrid engine: one engine that trains a policy and generates its rollouts (DeepSpeed's
``DeepSpeedHybridEngine``; ``initialize`` returns it when ``hybrid_engine.enabled``).

It is the training engine plus one part, the ``RolloutGenerator`` (inference/rollout.py), which owns
generation; this module only wires the two together:

* ``generate(...)`` (and the module's own ``generate``, which DeepSpeed-Chat calls as
  ``engine.module.generate``) goes to the part. Under ZeRO-3 the part makes the weights whole through
  ``zero.unwrap_model_for_generation`` (every parameter unit gathered once, hooks paused) and lets go of them
  when the call returns: training continues partitioned, from the same weights and optimizer state.
* ``inference_tp_size`` > 1 (ZeRO-3): consecutive data-parallel ranks form tensor groups; each rank splits
  the layers, ``tp_gather_partition_size`` at a time, into its tensor-parallel shards and the group decodes
  its ranks' prompts together (inference/tp_rollout.py). The model is never whole on a rank.
* every rank starts with rank 0's random state, as DeepSpeed's hybrid engine does, so sampled rollouts
  draw the same random numbers on every rank.
* ``eval()`` / ``train()`` switch the module as usual; ``eval()`` also logs, on rank 0, the time since the
  previous ``eval()`` and how the last ``generate`` split between gathering and decoding (DeepSpeed prints
  the same breakdown there).
"""

from __future__ import annotations

import functools
import time

import torch.distributed as dist

from shardspeed.accelerator import get_accelerator
from shardspeed.config import ConfigError
from shardspeed.inference.lora import fused_lora
from shardspeed.inference.rollout import RolloutGenerator
from shardspeed.inference.tp_rollout import TensorParallelSplit
from shardspeed.runtime.engine import ShardspeedEngine
from shardspeed.utils.logging import log_dist
from shardspeed.zero.api import GatheredParameters, hooks_paused, unwrap_model_for_generation

__all__ = ["HybridEngine"]


class HybridEngine(ShardspeedEngine):
    """``DeepSpeedHybridEngine``: the training engine with ``generate`` (see the module docstring)."""

    def __init__(self, model, config, **kwargs):
        super().__init__(model, config, **kwargs)
        _same_random_state_as_rank0(self.dp_group)
        settings = config.hybrid_engine
        self.Z3_enabled = self.zero_optimization_stage() == 3  # DeepSpeed's attribute names
        self.gather_all_layers = settings.pin_parameters
        own_generate = getattr(type(self.module), "generate", None)
        self.inference_tp_group = None  # the ranks this one decodes with (inference_tp_size > 1)
        tensor_parallel = self._tensor_parallel_split(settings) if settings.inference_tp_size > 1 else None
        self.rollout = RolloutGenerator(
            self.module,
            max_out_tokens=settings.max_out_tokens,
            release_cache=settings.release_inference_cache,
            model_generate=own_generate.__get__(self.module) if own_generate is not None else None,
            gathered=functools.partial(unwrap_model_for_generation, self),
            per_layer=self.Z3_enabled and not settings.pin_parameters,
            tensor_parallel=tensor_parallel,
        )
        # DeepSpeed-Chat generates through `actor_engine.module.generate(...)`: that is this engine's generate
        self.module.generate = self.generate
        self._eval_started: float | None = None
        self._lora_fused = None  # fuse_lora_weight's open fused_lora block

    def _tensor_parallel_split(self, settings) -> TensorParallelSplit:
        """Groups of ``inference_tp_size`` consecutive data-parallel ranks (DeepSpeed's layout), and this
        rank's split of the model over its group."""
        tp = settings.inference_tp_size
        why = None
        if not self.Z3_enabled:
            why = f"it splits ZeRO-3's partitioned weights, and zero_optimization.stage is {self.zero_optimization_stage()}"
        elif not settings.pin_parameters:
            why = "it needs hybrid_engine.pin_parameters true (the layers are split once per generate)"
        elif self.world_size % tp:
            why = f"it does not divide the {self.world_size} data-parallel ranks"
        else:
            why = TensorParallelSplit.check_layout(self.module, tp, settings.max_out_tokens)
        if why is not None:
            raise ConfigError(f"hybrid_engine.inference_tp_size: {tp} is not supported here: {why}")
        group = self.dp_group if self.dp_group is not None else dist.group.WORLD
        ranks = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
        for start in range(0, len(ranks), tp):  # every rank creates every group, in the same order
            members = ranks[start : start + tp]
            new = dist.new_group(members)
            if dist.get_rank() in members:
                self.inference_tp_group = new
        return TensorParallelSplit(
            self.module, self.inference_tp_group, settings.tp_gather_partition_size,
            gather=GatheredParameters, hooks_paused=functools.partial(hooks_paused, self),
        )  # fmt: skip

    def generate(self, *inputs, **kwargs):
        """Hugging Face ``generate``'s arguments and result; under ZeRO-3 one gather for the whole call."""
        return self.rollout.generate(*inputs, **kwargs)

    def fuse_lora_weight(self) -> None:
        """DeepSpeed's: run every LoRA linear fused until ``unfuse_lora_weight`` (``generate`` does this by
        itself). Here from fused copies, the base weights untouched (inference/lora.py); at ZeRO 0-2 only,
        where the weights are whole outside a gather."""
        if self.Z3_enabled:
            raise NotImplementedError(
                "fuse_lora_weight: under ZeRO-3 the base weights are whole only inside generate(), which fuses "
                "LoRA by itself; call generate() instead"
            )
        if self._lora_fused is None:
            self._lora_fused = fused_lora(self.module)
            self._lora_fused.__enter__()

    def unfuse_lora_weight(self) -> None:
        """Every LoRA linear runs its own forward again (after ``fuse_lora_weight``; otherwise nothing to do)."""
        if self._lora_fused is not None:
            fused, self._lora_fused = self._lora_fused, None
            fused.__exit__(None, None, None)

    def eval(self):
        now = time.perf_counter()
        if self._eval_started is not None and self.global_rank == 0 and self.rollout.calls:
            log_dist(
                f"hybrid engine: {now - self._eval_started:.2f}s since the previous eval(); last generate: "
                f"gather {self.rollout.last_gather_seconds:.3f}s, decode {self.rollout.last_generate_seconds:.3f}s"
            )
        self._eval_started = now
        return super().eval()

    def destroy(self) -> None:
        self.module.__dict__.pop("generate", None)  # the module's own generate again
        self.rollout.release()
        super().destroy()


def _same_random_state_as_rank0(group) -> None:
    """Every rank takes rank 0's device random state (one small broadcast at construction)."""
    accelerator = get_accelerator()
    state = accelerator.get_rng_state()
    on_device = state.to(accelerator.current_device_name())  # NCCL broadcasts device tensors only
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(on_device, src=src, group=group)
    accelerator.set_rng_state(on_device.cpu())
