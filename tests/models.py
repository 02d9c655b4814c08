"""Tiny models for tests: a GPT with tied embeddings and dropout, small enough for 4 CPU ranks.

Attention has no biases: the key bias gets a gradient that is pure rounding noise (softmax ignores it),
which Adam normalises into lr-sized steps, so runs that differ only in summation order would drift apart.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, bias=False, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x):
        seq = x.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Returns the mean cross-entropy of next-token prediction when called with a token batch."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16,
                 dropout: float = 0.0):  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, tokens):
        x = self.tok(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class DynamicGPT(TinyGPT):
    """TinyGPT whose execution changes with the step (set by the training loop through `set_step`): odd steps
    run the blocks in reverse order, and every third step skips the first block, whose parameters then get
    no gradient. ZeRO-3's recorded order is wrong on every step and some units are never gathered."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.step = 0

    def set_step(self, step: int) -> None:
        self.step = step

    def forward(self, tokens):
        blocks = list(self.blocks)
        if self.step % 3 == 2:
            blocks = blocks[1:]
        if self.step % 2 == 1:
            blocks = blocks[::-1]
        x = self.tok(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
        for block in blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def token_batches(steps: int, batch: int, seq: int = 17, vocab: int = 64, seed: int = 1234) -> torch.Tensor:
    """`steps` global batches of random tokens, shape [steps, batch, seq]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, batch, seq), generator=g)
