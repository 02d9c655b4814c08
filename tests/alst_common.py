"""Pieces of the ALST tests: an MLP stack with an LM head whose MLPs and loss can be tiled, and a tiny
Llama-shaped model that calls its attention the way Hugging Face models do (through a registry, with
[batch, heads, sequence, head size] tensors), so UlyssesSPAttentionHF is tested without Transformers."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

HIDDEN, VOCAB = 16, 24


class TileMLP(nn.Module):
    """`mode`: "plain", "tiled" (TiledMLP), "sequence" (sequence_tiled_compute) or "autograd" (untiled
    recompute); every mode computes the same function."""

    def __init__(self, mode: str = "plain", shards: int = 4):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.down = nn.Linear(3 * HIDDEN, HIDDEN)
        self.mode, self.shards = mode, shards

    def compute(self, x):
        return self.down(F.gelu(self.up(x)))

    def forward(self, x):
        from shardspeed.sequence.tiled import AutogradComputeMLP, TiledMLP, sequence_tiled_compute

        params = list(self.parameters())
        if self.mode == "tiled":
            return TiledMLP.apply(TileMLP.compute, self, x, self.shards, params)
        if self.mode == "sequence":
            return sequence_tiled_compute(TileMLP.compute, x.shape[1], self.shards, {"x": x}, {"self": self}, "x",
                                          params, output_unshard_dimension=1, output_reduction=None)  # fmt: skip
        if self.mode == "autograd":
            return AutogradComputeMLP.apply(TileMLP.compute, self, x)
        return self.compute(x)


def head_loss(head: nn.Linear, x, y, mask=None):
    """Mean cross-entropy of `head(x)` against `y` (over the tokens `mask` keeps)."""
    logits = head(x).reshape(-1, VOCAB).float()
    if mask is None:
        return F.cross_entropy(logits, y.reshape(-1))
    losses = F.cross_entropy(logits, y.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum() / mask.sum()


class TileModel(nn.Module):
    """Embedding, two MLPs (a stack, so the second's backward feeds the first's), LM head + loss."""

    def __init__(self, mlp_mode: str = "plain", tiled_loss: bool = False, loss_shards: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp1, self.mlp2 = TileMLP(mlp_mode), TileMLP(mlp_mode)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.tiled_loss, self.loss_shards = tiled_loss, loss_shards

    def forward(self, tokens, labels):
        from shardspeed.sequence.tiled import TiledFusedLogitsLoss

        x = self.embed(tokens)
        x = x + self.mlp1(x)
        x = x + self.mlp2(x)
        if self.tiled_loss:
            return TiledFusedLogitsLoss.apply(head_loss, self.lm_head, x, labels, None, self.loss_shards,
                                              [self.lm_head.weight], "mean")  # fmt: skip
        return head_loss(self.lm_head, x, labels)


# -- a tiny Llama-shaped model with Hugging Face's attention calling convention ------------------------------

HEADS, HEAD_SIZE, LAYERS, SEQ = 4, 8, 2, 16
ATTENTION_FUNCTIONS: dict = {}  # stands in for transformers' ALL_ATTENTION_FUNCTIONS


def sdpa_attention(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """HF's sdpa convention: [b, H, s, d] in (key/value heads repeated for GQA), [b, s, H, d] out, causal
    when no mask is given. `position_ids` must cover the whole sequence the query covers."""
    assert position_ids is not None and position_ids.shape[1] == query.shape[2], "position ids not gathered"
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None
    )
    return out.transpose(1, 2), None


class HFStyleAttention(nn.Module):
    def __init__(self, kv_heads: int):
        super().__init__()
        self.kv_heads, self.num_key_value_groups = kv_heads, HEADS // kv_heads
        self.q = nn.Linear(HEADS * HEAD_SIZE, HEADS * HEAD_SIZE, bias=False)
        self.kv = nn.Linear(HEADS * HEAD_SIZE, 2 * kv_heads * HEAD_SIZE, bias=False)
        self.o = nn.Linear(HEADS * HEAD_SIZE, HEADS * HEAD_SIZE, bias=False)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_SIZE).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, HEAD_SIZE).unbind(2)
        # a rotary-like position signal, so that wrong positions would change the result
        q = q + torch.sin(position_ids.float()).view(b, 1, s, 1)
        out, _ = ATTENTION_FUNCTIONS["sdpa"](self, q, k.transpose(1, 2), v.transpose(1, 2), None,
                                             position_ids=position_ids)  # fmt: skip
        return self.o(out.reshape(b, s, -1))


class HFStyleLlama(nn.Module):
    """(input_ids, position_ids) [b, s_local] -> logits; the loss is the caller's (as the Trainer's is)."""

    def __init__(self, kv_heads: int):
        super().__init__()
        dim = HEADS * HEAD_SIZE
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(HFStyleAttention(kv_heads) for _ in range(LAYERS))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
                                  for _ in range(LAYERS))  # fmt: skip
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, input_ids, position_ids):
        x = self.embed(input_ids)
        for attn, mlp in zip(self.layers, self.mlps):
            x = x + attn(x, position_ids)
            x = x + mlp(x)
        return self.head(x)


def shifted_loss_sum(logits, shift_labels):
    """(sum of the token losses, number of counted tokens), -100 labels skipped."""
    losses = F.cross_entropy(logits.reshape(-1, VOCAB).float(), shift_labels.reshape(-1), reduction="sum",
                             ignore_index=-100)  # fmt: skip
    return losses, (shift_labels != -100).sum()
