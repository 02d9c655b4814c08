"""DeepSpeed's `runtime.rollout.hybrid_engine_rollout.HybridEngineRollout`: the rollout backend that generates
with the training engine itself; and `runtime.rollout.build_rollout`, which makes it.

`generate` takes a `RolloutRequest` and a `SamplingConfig`, repeats each prompt `n_samples_per_prompt` times,
and calls the engine's `module.generate` (on shardspeed's hybrid engine that is `engine.generate`: under
ZeRO-3 one gather for the whole call) with Hugging Face's arguments — greedy when `temperature <= 0`, else
sampling with `temperature`, `top_p` and `top_k` (`top_k <= 0`: no top-k filter). The result is DeepSpeed's
layout: every row is prompt + `max_new_tokens` columns, the first EOS of a response kept and every later
position padding, the attention mask 1 on real prompt tokens and on the response up to its first EOS, and
`response_start_idx` the prompt width. The weights are the engine's own, so `sync_weights` has nothing to do.

DeepSpeed's own decode loops are not built, and their options are refused by name where they would act:
CUDA-graph capture of the greedy decode (`use_graph_capture`, at a greedy `generate`), continuous batching
(`SamplingConfig.continuous_batch_size`), and the profiling, shared-prefill and cache options of that loop (at
construction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardspeed.compat.mirrors.rollout import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig
from shardspeed.compat.not_offered import NotOfferedError

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig", "build_rollout"]

_PREFIX = "deepspeed.runtime.rollout.hybrid_engine_rollout"


@dataclass
class HybridEngineRolloutConfig:
    """HybridEngineRollout's options (DeepSpeed's fields; only the defaults of the last five are offered)."""

    use_graph_capture: bool = False
    """Capture the greedy decode step as a CUDA graph (not built: refused at a greedy generate)."""
    enable_profiling: bool = False
    use_shared_prefill: bool = False
    align_decode_fronts: bool = False
    enable_cache_trimming: bool = False
    continuous_cache_capacity: int | None = None


# options of DeepSpeed's own decode loops, and their values that ask for nothing
_LOOP_OPTIONS = {
    "enable_profiling": False,
    "use_shared_prefill": False,
    "align_decode_fronts": False,
    "enable_cache_trimming": False,
    "continuous_cache_capacity": None,
}


class HybridEngineRollout(RolloutEngine):
    """Generates rollouts with the training `engine` (see the module docstring); `tokenizer` supplies the pad
    and EOS token ids."""

    name = "hybrid_engine"

    def __init__(self, engine, tokenizer, cfg=None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.use_graph_capture = bool(getattr(cfg, "use_graph_capture", False))
        asked = [name for name, off in _LOOP_OPTIONS.items() if getattr(cfg, name, off) != off]
        if asked:
            raise NotOfferedError(
                f"{_PREFIX}.HybridEngineRolloutConfig: {', '.join(asked)} is not offered by shardspeed: DeepSpeed's "
                "own decode loop (profiling, shared prefill, continuous-batching cache) is not built; generate "
                "runs the engine's generate"
            )

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        if sampling.continuous_batch_size is not None:
            raise NotOfferedError(
                f"{_PREFIX}: SamplingConfig.continuous_batch_size is not offered by shardspeed: continuous "
                "batching is not built (leave it None: the whole request is one batch)"
            )
        greedy = sampling.temperature <= 0.0
        if greedy and self.use_graph_capture:
            raise NotOfferedError(
                f"{_PREFIX}: use_graph_capture is not offered by shardspeed: CUDA-graph capture of the greedy "
                "decode step is not built (the engine's generate runs its own KV-cache decode)"
            )
        pad, eos = self._pad_and_eos()
        n = sampling.n_samples_per_prompt
        prompt_ids = request.prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = request.prompt_attention_mask.repeat_interleave(n, dim=0)
        arguments = {
            "attention_mask": prompt_mask,
            "max_new_tokens": sampling.max_new_tokens,
            "do_sample": not greedy,
            "pad_token_id": pad,
            "eos_token_id": eos,
        }
        if not greedy:
            arguments.update(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0)
            )
        output = self.engine.module.generate(prompt_ids, **arguments)
        prompt_width = prompt_ids.shape[1]
        # generation may stop once every row has its EOS: right-pad to DeepSpeed's fixed width
        missing = prompt_width + sampling.max_new_tokens - output.shape[1]
        output = F.pad(output, (0, missing), value=pad) if missing > 0 else output
        output, response_mask = _pad_after_first_eos(output, prompt_width, eos, pad)
        attention_mask = torch.cat([prompt_mask.to(output.device, torch.long), response_mask], dim=1)
        starts = torch.full((output.shape[0],), prompt_width, dtype=torch.long, device=output.device)
        return RolloutBatch(input_ids=output, attention_mask=attention_mask, response_start_idx=starts)

    def sync_weights(self, step: int) -> None:
        """Nothing to do: generation reads the training engine's weights as they are."""
        del step
        return None

    def _pad_and_eos(self) -> tuple[int, int | None]:
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        if pad is None:
            raise ValueError("The tokenizer must define pad_token_id or eos_token_id")
        return pad, eos


def build_rollout(rollout_cfg, student_engine=None, tokenizer=None, **kwargs) -> RolloutEngine:
    """The backend `rollout_cfg.engine` names, for `student_engine` (the training engine) and `tokenizer`.

    ValueError for an unknown backend, or for "hybrid_engine" without both the engine and the tokenizer (as in
    DeepSpeed).
    """
    name = rollout_cfg.engine
    if name != "hybrid_engine":
        raise ValueError(f"Unknown rollout engine {name!r}; choose from 'hybrid_engine'")
    if student_engine is None or tokenizer is None:
        raise ValueError("hybrid_engine rollout needs both student_engine and tokenizer")
    from shardspeed.compat.mirrors.rollout_hybrid_engine import (
        HybridEngineRollout,
    )  # it builds on this module

    return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg, **kwargs)


def _pad_after_first_eos(output: torch.Tensor, start: int, eos: int | None, pad: int):
    """(`output` with every response position after its first EOS set to `pad`, the responses' attention mask:
    1 on non-pad tokens and on the first EOS (which may equal `pad`), 0 after it)."""
    response = output[:, start:]
    if eos is None or response.shape[1] == 0:
        return output, (response != pad).long()
    is_eos = response == eos
    has_eos = is_eos.any(dim=1, keepdim=True)
    first = is_eos.long().argmax(dim=1, keepdim=True)
    positions = torch.arange(response.shape[1], device=response.device).unsqueeze(0)
    after = has_eos & (positions > first)
    at_first = has_eos & (positions == first)
    output = output.clone()
    output[:, start:] = response.masked_fill(after, pad)
    mask = ((response != pad) | at_first) & ~after
    return output, mask.long()
