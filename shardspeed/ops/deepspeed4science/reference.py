"""The plain Evoformer attention that `DS4Sci_EvoformerAttention` must equal: whole logits, softmax, autograd.

It holds [batch, n_seq, heads, n_res, n_res] logits and probabilities, which is what runs out of memory at
large n_seq x n_res; tests and benchmarks/evoformer.py compare against it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["evoformer_attention_reference"]


def evoformer_attention_reference(q, k, v, biases) -> torch.Tensor:
    """softmax(Q K^T / sqrt(dim) + biases) V over the residue axis, for [batch, n_seq, n_res, heads, dim]
    inputs and biases that broadcast to [batch, n_seq, heads, n_res, n_res] (None entries skipped)."""
    qh, kh, vh = (t.transpose(-2, -3) for t in (q, k, v))
    logits = torch.matmul(qh, kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    for bias in biases:
        if bias is not None:
            logits = logits + bias
    return torch.matmul(torch.softmax(logits, dim=-1), vh).transpose(-2, -3)
