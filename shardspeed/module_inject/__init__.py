"""Tensor-parallel module replacement (DeepSpeed's `deepspeed.module_inject`): AutoTP and its layers."""

from shardspeed.module_inject.auto_tp import TPReport, shard_model
from shardspeed.module_inject.layers import LinearAllreduce, LinearLayer
from shardspeed.module_inject.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "LinearAllreduce",
    "LinearLayer",
    "TPReport",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "shard_model",
    "vocab_parallel_cross_entropy",
]
