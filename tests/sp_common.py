"""Pieces of the Ulysses sequence-parallel tests: a small transformer built on DistributedAttention, its data,
the one-process reference, and a counter of the activation bytes autograd saves."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from common import LR, warmup_lr

VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 2
SEQ = 64  # 4x the base tests' sequence (16)


class CausalAttention(nn.Module):
    """The local attention DistributedAttention wraps: [b, s, h, d] (or [s, b, h, d]) in and out, causal."""

    def __init__(self, seq_first: bool = False):
        super().__init__()
        self.seq_first = seq_first

    def forward(self, q, k, v):
        to_bhsd = (1, 2, 0, 3) if self.seq_first else (0, 2, 1, 3)
        out = F.scaled_dot_product_attention(*(t.permute(to_bhsd) for t in (q, k, v)), is_causal=True)
        return out.permute(2, 0, 1, 3) if self.seq_first else out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.attn = CausalAttention()
        self.batch_dim_idx = None  # set when attn is a DistributedAttention

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        if self.batch_dim_idx is None:
            context = self.attn(q, k, v)
        elif self.batch_dim_idx == 0:  # [b, s, h, d]
            context = self.attn(q, k, v, 0)
        else:  # the sequence-first layout [s, b, h, d], DeepSpeed's Megatron default
            context = self.attn(*(t.transpose(0, 1) for t in (q, k, v)), 1).transpose(0, 1)
        x = x + self.out(context.reshape(b, s, DIM))
        return x + self.mlp(self.ln2(x))


class UlyssesGPT(nn.Module):
    """(input_ids, position_ids, labels), each [b, s_local] -> mean cross-entropy over the local tokens."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def use_sequence_group(self, group, batch_dim_idx: int = 0):
        """Wrap every block's local attention in DistributedAttention over `group`, in either layout."""
        from shardspeed.sequence import DistributedAttention

        for block in self.blocks:
            local = CausalAttention(seq_first=batch_dim_idx == 1)
            block.attn = DistributedAttention(local, group, scatter_idx=2, gather_idx=0)
            block.batch_dim_idx = batch_dim_idx

    def forward(self, input_ids, position_ids, labels, reduction="mean"):
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction=reduction)


def token_data(steps: int, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, batch, SEQ + 1), generator=g)


def full_micro_batch(data, step: int, micro_index: int, dp_rank: int, dp: int, micro: int):
    """The whole-sequence micro-batch of data rank `dp_rank`: (input_ids, position_ids, labels)."""
    start = (micro_index * dp + dp_rank) * micro
    tokens = data[step, start : start + micro]
    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    return tokens[:, :-1], positions, tokens[:, 1:]


def reference_run(steps: int, dp: int, micro: int = 2, gas: int = 2, clip: float = 0.5) -> dict:
    """One process, whole sequences: the same global batches, torch AdamW, torch's clip_grad_norm_."""
    torch.manual_seed(0)
    model = UlyssesGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    data = token_data(steps, micro * gas * dp)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step)
        for m in range(gas):
            for r in range(dp):
                (model(*full_micro_batch(data, step, m, r, dp, micro)) / (gas * dp)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def saved_activation_bytes(module, *inputs) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(*inputs)
    loss.backward()
    module.zero_grad(set_to_none=True)
    return sum(seen.values())
