"""DeepSpeed's `deepspeed.runtime.rollout` interface: how an RL or distillation trainer asks for on-policy
generations, independent of the engine that makes them.

Three dataclasses carry the exchange — `RolloutRequest` (left-padded prompts in), `SamplingConfig` (the
sampling knobs of one call), `RolloutBatch` (prompt + response in one tensor out) — and check their shapes
when built; `RolloutEngine` is the abstract base a backend implements (`generate`, `sync_weights`,
`shutdown`); `build_rollout` (with the backend, in rollout_hybrid_engine.py) picks the backend named by
`RolloutConfig.engine`.

DeepSpeed's one backend, `HybridEngineRollout`, generates with the training engine's own `generate`
(rollout_hybrid_engine.py; shardspeed/inference/rollout.py is the decode behind it); a trainer may also bring
its own `RolloutEngine` subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

# DeepSpeed's `runtime.rollout` is a package: a search path lets `runtime.rollout.base`, `.opsd`, ... import
# (the path table answers them)
__path__: list[str] = []

__all__ = [
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
]


@dataclass
class RolloutConfig:
    """Which rollout backend `build_rollout` makes."""

    engine: str = "hybrid_engine"
    use_graph_capture: bool = False
    """Capture the decode step as a CUDA graph (a HybridEngineRollout option)."""


@dataclass
class SamplingConfig:
    """The sampling knobs a trainer passes with each `generate` call; `top_k <= 0` means no top-k filter."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: int | None = None


def _shape(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape)


@dataclass
class RolloutRequest:
    """`generate`'s input: prompts left-padded (real tokens at the right edge) to width T_p."""

    prompt_ids: torch.Tensor
    """[B, T_p] token ids."""
    prompt_attention_mask: torch.Tensor
    """[B, T_p], 1 on real prompt tokens."""

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be 2-D [B, T_p]; got {_shape(self.prompt_ids)}")
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise ValueError(
                f"prompt_attention_mask shape {_shape(self.prompt_attention_mask)} does not match prompt_ids "
                f"{_shape(self.prompt_ids)}"
            )


@dataclass
class RolloutBatch:
    """`generate`'s output: each row is its (left-padded) prompt followed by its response, right-padded;
    B' = B * n_samples_per_prompt rows."""

    input_ids: torch.Tensor
    """[B', T_p + T_r] token ids."""
    attention_mask: torch.Tensor
    """[B', T_p + T_r], 1 on real tokens."""
    response_start_idx: torch.Tensor
    """[B'] the column where each row's response begins."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D; got {_shape(self.input_ids)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"attention_mask shape {_shape(self.attention_mask)} does not match input_ids {_shape(self.input_ids)}"
            )
        rows = self.input_ids.shape[0]
        if self.response_start_idx.shape != (rows,):
            raise ValueError(
                f"response_start_idx must be 1-D of length {rows}; got {_shape(self.response_start_idx)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """A rollout backend: generates responses for a trainer and receives its updated weights."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Generate responses to `request`'s prompts; prompt and response in one tensor."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Bring the trainer's weights after optimizer step `step` into the backend (nothing to do where the
        backend shares the training engine's weights)."""

    def shutdown(self) -> None:
        """Release the backend's resources (none by default)."""
        return None
