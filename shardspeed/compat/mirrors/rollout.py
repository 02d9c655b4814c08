"""DeepSpeed's `deepspeed.runtime.rollout` interface: how an RL or distillation trainer asks for on-policy
generations, independent of the engine that makes them.

Three dataclasses carry the exchange — `RolloutRequest` (left-padded prompts in), `SamplingConfig` (the
sampling knobs of one call), `RolloutBatch` (prompt + response in one tensor out) — and check their shapes
when built; `RolloutEngine` is the abstract base a backend implements (`generate`, `sync_weights`,
`shutdown`); `build_rollout` picks the backend named by `RolloutConfig.engine`.

DeepSpeed's one backend, `HybridEngineRollout` (its own decode loop with continuous batching and CUDA-graph
capture), is not built, so `build_rollout` refuses it by name once its arguments are complete. A trainer
generates with the hybrid engine itself (`engine.generate`, Hugging Face `generate`'s arguments; see
shardspeed/inference/rollout.py) or brings its own `RolloutEngine` subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from shardspeed.compat.finder import resolve

# DeepSpeed's `runtime.rollout` is a package: a search path lets `runtime.rollout.base`, `.opsd`, ... import
# (the path table answers them)
__path__: list[str] = []

__all__ = [
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "build_rollout",
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


def build_rollout(rollout_cfg, student_engine=None, tokenizer=None, **kwargs) -> RolloutEngine:
    """The backend `rollout_cfg.engine` names, for `student_engine` (the training engine) and `tokenizer`.

    ValueError for an unknown backend, or for "hybrid_engine" without both the engine and the tokenizer (as in
    DeepSpeed); NotOfferedError for "hybrid_engine" given both, since that backend is not built here.
    """
    name = rollout_cfg.engine
    if name != "hybrid_engine":
        raise ValueError(f"Unknown rollout engine {name!r}; choose from 'hybrid_engine'")
    if student_engine is None or tokenizer is None:
        raise ValueError("hybrid_engine rollout needs both student_engine and tokenizer")
    backend = resolve(
        "runtime.rollout.HybridEngineRollout"
    )  # the table's stand-in: calling it raises, saying why
    return backend(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg, **kwargs)
