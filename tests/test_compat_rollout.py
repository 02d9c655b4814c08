"""DeepSpeed's `runtime.rollout` interface (compat/mirrors/rollout.py): the request, sampling and batch
dataclasses check their shapes, a `RolloutEngine` subclass generates through them (here a backend that
answers with a real model's greedy tokens), and `build_rollout` refuses what it cannot build, by name.
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


def test_build_rollout_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="Unknown rollout engine 'vllm'"):
        build_rollout(RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match="needs both student_engine and tokenizer"):
        build_rollout(RolloutConfig(), student_engine=object())
    with pytest.raises(
        NotOfferedError, match=r"deepspeed\.runtime\.rollout\.HybridEngineRollout is not offered"
    ):
        build_rollout(RolloutConfig(), student_engine=object(), tokenizer=object())
