"""Small transformer models for the tensor-parallel tests, written the way Hugging Face writes them.

`LlamaLike`: RMSNorm, rotary position embeddings, grouped-query attention (`q_proj`..`o_proj`, k/v with
fewer heads), SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`). `Gpt2Like`: LayerNorm, learned positions,
a fused `c_attn` in HF's transposed `Conv1D` (weight [in, out]), `c_proj`, `c_fc`. Both return the mean
next-token loss of a batch of token ids; with `vocab_parallel=True` they compute it with
`vocab_parallel_cross_entropy` from the LM head's vocabulary slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 16


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 Conv1D: y = x @ W + b with W of shape [in, out]."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        return x @ self.weight + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over [batch, heads, seq, head_dim]."""
    d, seq = x.shape[-1], x.shape[-2]
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, bias: bool = False):
        super().__init__()
        self.head_dim = dim // heads
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden, bias):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim), RMSNorm(dim)
        self.self_attn = LlamaAttention(dim, heads, kv_heads, bias)
        self.mlp = LlamaMLP(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _LM(nn.Module):
    vocab_parallel = False

    def loss(self, logits, targets):
        if self.vocab_parallel:
            from shardspeed.module_inject import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits, targets, self.lm_head.tp_group)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, ids):
        inputs, targets = ids[:, :-1], ids[:, 1:]
        return self.loss(self.lm_head(self.hidden(inputs)), targets)


class LlamaLike(_LM):
    checkpoint_layers = False  # run each layer under shardspeed.checkpointing.checkpoint

    def __init__(self, dim=32, heads=4, kv_heads=2, hidden=48, layers=2, bias=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(LlamaLayer(dim, heads, kv_heads, hidden, bias) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def hidden(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            if self.checkpoint_layers:
                from shardspeed import checkpointing

                x = checkpointing.checkpoint(layer, x)
            else:
                x = layer(x)
        return self.norm(x)


class Gpt2Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.split_size = heads, dim // heads, dim
        self.c_attn = Conv1D(3 * dim, dim)
        self.c_proj = Conv1D(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))


class Gpt2Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Gpt2Attention(dim, heads)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(4 * dim, dim), Conv1D(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class Gpt2Like(_LM):
    def __init__(self, dim=32, heads=4, layers=2, tie=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.h = nn.ModuleList(Gpt2Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def hidden(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


def build(kind: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return {"llama": LlamaLike, "gpt2": Gpt2Like}[kind](**kwargs)


def batches(steps: int, batch: int, seed: int = 7) -> torch.Tensor:
    """[steps, batch, SEQ + 1] token ids (the global batch of each step)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, batch, SEQ + 1), generator=g)
