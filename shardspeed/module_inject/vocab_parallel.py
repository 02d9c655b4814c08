"""Vocabulary-parallel embedding, LM head and cross-entropy: the vocabulary split over the tensor group.

Rank r holds rows `[r*V/tp, (r+1)*V/tp)` of the embedding table and of the LM head. The embedding looks up
the ids in its range (others read as zero) and the partial embeddings are summed over the group. The LM
head returns only this rank's slice of the logits; `vocab_parallel_cross_entropy` computes the loss from
those slices with three all-reduces of one number per token (max, sum of exponentials, target logit), so
the full `[tokens, V]` logits never exist on any rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardspeed.module_inject.layers import LinearLayer, TPPartition, _sharded_parameter
from shardspeed.module_inject.tp_comm import group_size, reduce_from_tensor_parallel

__all__ = ["VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_cross_entropy"]


def _vocab_range(vocab: int, group) -> tuple[int, int]:
    tp = group_size(group)
    rank = dist.get_rank(group) if tp > 1 else 0
    per_rank = vocab // tp
    return rank * per_rank, (rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """An `nn.Embedding` whose rows are split over the tensor group."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group, padding_idx=None):
        super().__init__()
        self.weight = weight
        self.num_embeddings = vocab_size
        self.embedding_dim = weight.shape[1]
        self.padding_idx = padding_idx
        self.tp_group = group
        self.vocab_start, self.vocab_end = _vocab_range(vocab_size, group)

    @classmethod
    def from_module(cls, module: nn.Embedding, group, rank: int):
        vocab = module.weight.shape[0]
        part = TPPartition(0, (vocab,), group_size(group))
        part.check(f"vocabulary-parallel embedding (vocabulary {vocab})")
        weight = _sharded_parameter(module.weight, part, rank, module.weight.requires_grad)
        return cls(weight, vocab, group, getattr(module, "padding_idx", None))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.tp_group)


class VocabParallelLMHead(LinearLayer):
    """Column-parallel LM head: returns this rank's slice of the logits (pass them to
    `vocab_parallel_cross_entropy`)."""

    vocab_parallel = True


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        vocab_local = logits.shape[-1]
        local_target = target - vocab_start
        inside = (local_target >= 0) & (local_target < vocab_local) & (target != ignore_index)
        picked = shifted.gather(-1, local_target.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = picked.masked_fill(~inside, 0.0)
        dist.all_reduce(target_logit, group=group)
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, inside, valid, count)
        return loss.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, inside, valid, count = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = inside.nonzero(as_tuple=True)
        grad_logits[rows + (local_target[rows],)] -= 1.0
        grad_logits.mul_(valid.unsqueeze(-1)).mul_(grad / count)
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose target is not `ignore_index`, from vocabulary-split logits
    (`[..., V/tp]` on every rank of `group`). Equal to `F.cross_entropy` on the full logits."""
    if group_size(group) == 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                               ignore_index=ignore_index)  # fmt: skip
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    out = _VocabParallelCrossEntropy.apply(flat_logits, target.reshape(-1), group, vocab_start, ignore_index)
    return out.to(logits.dtype) if logits.dtype != torch.float32 else out
