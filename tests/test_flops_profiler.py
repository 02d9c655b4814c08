"""Flops profiler: a GPT's forward FLOPs equal the analytic count (2·N·tokens for the matmuls plus the
attention term, SDPA included), per-module attribution, the printed report, and get_model_profile."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from shardspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=3, heads=4, seq=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.blocks(x))


def analytic_forward_flops(vocab, dim, layers, seq, batch):
    matmul_params = layers * 12 * dim * dim + dim * vocab  # qkv, proj, two MLP matrices; the head
    tokens = batch * seq
    attention = layers * 2 * (2 * batch * seq * seq * dim)  # QK^T and AV, full square as torch counts it
    return 2 * matmul_params * tokens + attention, attention


def test_gpt_forward_flops_match_the_analytic_count_and_sdpa_is_counted():
    torch.manual_seed(0)
    vocab, dim, layers, seq, batch = 256, 64, 3, 32, 4
    model = GPT(vocab, dim, layers, 4, seq)
    tokens = torch.randint(0, vocab, (batch, seq))
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(tokens)
    prof.stop_profile()
    expected, attention = analytic_forward_flops(vocab, dim, layers, seq, batch)
    flops = prof.get_total_flops()
    assert abs(flops - expected) / expected < 0.01, (flops, expected)
    assert prof.get_total_macs() == flops // 2
    # attention is counted: without it the total would be short by exactly the attention term
    blocks_flops = sum(prof.module_profile(b)["flops"] for b in model.blocks)
    linear_flops = sum(prof.module_profile(m)["flops"] for b in model.blocks for m in b.modules()
                       if isinstance(m, nn.Linear))  # fmt: skip
    assert blocks_flops - linear_flops == attention
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())
    assert prof.module_profile(model.head)["flops"] == 2 * dim * vocab * batch * seq
    assert prof.get_total_duration() > 0
    assert prof.module_profile(model.blocks[0])["latency"] > 0
    text = prof.print_model_profile(profile_step=3, module_depth=2, top_modules=2)
    assert "Profile Summary at step 3:" in text
    assert "fwd MACs per GPU" in text and "depth 1:" in text and "(qkv): Linear(" not in text  # depth 3 cut
    assert "(blocks): Sequential(" in text
    prof.end_profile()
    assert prof.get_total_flops() == 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_get_model_profile(tmp_path):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flops, macs, params = get_model_profile(model, input_shape=(5, 8), print_profile=True, as_string=False,
                                            output_file=str(tmp_path / "p.txt"))  # fmt: skip
    assert macs == 5 * (8 * 16 + 16 * 4) and flops == 2 * macs
    assert params == 8 * 16 + 16 + 16 * 4 + 4
    assert "Detailed Profile per GPU" in (tmp_path / "p.txt").read_text()
    as_text = get_model_profile(model, args=[torch.randn(5, 8)], print_profile=False)
    assert as_text == ("1.92 K", "960.00 MACs", "212.00")
    with pytest.raises(ValueError, match="input_shape, args or kwargs"):
        get_model_profile(model)
