"""DeepSpeed's `runtime.rollout` interface (compat/mirrors/rollout.py): the request, sampling and batch
dataclasses check their shapes, a `RolloutEngine` subclass generates through them (here a backend that
answers with a real model's greedy tokens), and `build_rollout` makes the backend its config names.

`HybridEngineRollout` (compat/mirrors/rollout_hybrid_engine.py) on a real hybrid engine: its greedy rollout is
the model's greedy tokens, each prompt repeated `n_samples_per_prompt` times, cut after the first EOS with
DeepSpeed's padding and masks; a sampled rollout has the same layout; DeepSpeed's decode-loop options are
refused by name.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.compat.not_offered import NotOfferedError
from shardspeed.runtime.rollout import (
    RolloutBatch,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
)
from shardspeed.runtime.rollout.base import RolloutConfig
from shardspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig

from harness import run_ranks
from inference_models import TinyLlama, greedy_reference

PAD = 0


class GreedyRollout(RolloutEngine):
    """A backend over a tiny causal model: appends its argmax tokens (no KV cache; the test is the interface)."""

    name = "greedy"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.synced: list[int] = []

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        n = sampling.n_samples_per_prompt
        ids = request.prompt_ids.repeat_interleave(n, dim=0)
        mask = request.prompt_attention_mask.repeat_interleave(n, dim=0)
        start = ids.shape[1]
        for _ in range(sampling.max_new_tokens):
            next_token = self.model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_token], dim=1)
            mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
        return RolloutBatch(ids, mask, torch.full((ids.shape[0],), start, dtype=torch.long))

    def sync_weights(self, step: int) -> None:
        self.synced.append(step)


def test_dataclasses_check_their_shapes():
    with pytest.raises(ValueError, match="must be 2-D"):
        RolloutRequest(prompt_ids=torch.zeros(4), prompt_attention_mask=torch.ones(4))
    with pytest.raises(ValueError, match=r"shape \(2, 5\) does not match prompt_ids \(2, 4\)"):
        RolloutRequest(prompt_ids=torch.zeros(2, 4), prompt_attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="response_start_idx must be 1-D of length 2"):
        RolloutBatch(torch.zeros(2, 4), torch.ones(2, 4), torch.tensor([1]))
    batch = RolloutBatch(torch.zeros(3, 6), torch.ones(3, 6), torch.tensor([2, 2, 2]))
    assert (batch.batch_size, batch.seq_len) == (3, 6)
    sampling = SamplingConfig(max_new_tokens=8)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.n_samples_per_prompt) == (
        1.0,
        1.0,
        -1,
        1,
    )
    assert sampling.continuous_batch_size is None and RolloutConfig().engine == "hybrid_engine"


def test_a_backend_generates_through_the_interface():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    backend = GreedyRollout(model)
    prompts = torch.tensor([[0, 3, 4], [5, 6, 7]])
    request = RolloutRequest(prompts, torch.tensor([[0, 1, 1], [1, 1, 1]]))
    batch = backend.generate(request, SamplingConfig(max_new_tokens=2, n_samples_per_prompt=2))
    assert batch.input_ids.shape == (4, 5) and batch.response_start_idx.tolist() == [3] * 4
    assert torch.equal(batch.input_ids[:, :3], prompts.repeat_interleave(2, dim=0))
    expected_first = model(prompts)[:, -1].argmax(-1).repeat_interleave(2)
    assert torch.equal(batch.input_ids[:, 3], expected_first)
    assert batch.attention_mask[1].tolist() == [0, 1, 1, 1, 1]
    backend.sync_weights(7)
    assert backend.synced == [7] and backend.shutdown() is None
    with pytest.raises(TypeError, match="abstract"):
        RolloutEngine()


def test_build_rollout_makes_the_backend_its_config_names():
    with pytest.raises(ValueError, match="Unknown rollout engine 'vllm'"):
        build_rollout(RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match="needs both student_engine and tokenizer"):
        build_rollout(RolloutConfig(), student_engine=object())
    rollout = build_rollout(RolloutConfig(), student_engine="engine", tokenizer="tokenizer")
    assert isinstance(rollout, HybridEngineRollout) and rollout.engine == "engine"
    assert rollout.sync_weights(step=3) is None and not rollout.use_graph_capture
    with pytest.raises(NotOfferedError, match="enable_profiling, use_shared_prefill is not offered"):
        HybridEngineRollout(
            None, None, HybridEngineRolloutConfig(enable_profiling=True, use_shared_prefill=True)
        )


class _Tokenizer:
    def __init__(self, eos: int) -> None:
        self.pad_token_id, self.eos_token_id = PAD, eos


def _hybrid_rollouts() -> dict:
    import shardspeed

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32},
    }
    engine, *_ = shardspeed.initialize(model=TinyLlama(vocab=64), config=config)
    prompts = torch.tensor([[5, 9, 3, 17], [8, 2, 30, 11]])
    with torch.no_grad():
        reference = [greedy_reference(engine.module, row.tolist(), 6) for row in prompts]
    eos = reference[0][2]  # the first prompt's response ends at its third token
    rollout = HybridEngineRollout(engine, _Tokenizer(eos), HybridEngineRolloutConfig(use_graph_capture=True))
    request = RolloutRequest(prompts, torch.ones_like(prompts))
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.8, top_k=5, n_samples_per_prompt=2)
    sampled = rollout.generate(request, sampling)
    refused = ""
    try:  # graph capture would act on a greedy rollout: refused there, by name
        rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=0.0))
    except NotOfferedError as error:
        refused = str(error)
    rollout.use_graph_capture = False
    greedy = rollout.generate(
        request, SamplingConfig(max_new_tokens=6, temperature=0.0, n_samples_per_prompt=2)
    )
    engine.destroy()
    return {"reference": reference, "eos": eos, "greedy": greedy, "sampled": sampled, "refused": refused}


def _cut_after_eos(response: list[int], eos: int) -> tuple[list[int], list[int]]:
    """DeepSpeed's layout of one response: tokens up to the first EOS, then padding; its attention mask."""
    end = response.index(eos) + 1 if eos in response else len(response)
    return response[:end] + [PAD] * (len(response) - end), [1] * end + [0] * (len(response) - end)


def test_hybrid_engine_rollout_is_the_models_generation_in_deepspeeds_layout():
    (result,) = run_ranks(_hybrid_rollouts, 1)
    greedy, eos = result["greedy"], result["eos"]
    assert greedy.input_ids.shape == (4, 10) and greedy.response_start_idx.tolist() == [4] * 4
    for row in range(4):
        prompt = [[5, 9, 3, 17], [8, 2, 30, 11]][row // 2]
        tokens, mask = _cut_after_eos(result["reference"][row // 2], eos)
        assert greedy.input_ids[row].tolist() == prompt + tokens
        assert greedy.attention_mask[row].tolist() == [1] * 4 + mask
    assert greedy.input_ids[0, 7:].tolist() == [PAD] * 3  # the first prompt's EOS is its third token
    sampled = result["sampled"]
    assert sampled.input_ids.shape == (4, 10) and sampled.response_start_idx.tolist() == [4] * 4
    assert ((sampled.input_ids >= 0) & (sampled.input_ids < 64)).all()
    assert "use_graph_capture is not offered by shardspeed" in result["refused"]
