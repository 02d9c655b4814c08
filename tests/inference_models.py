"""A tiny Llama-layout causal LM written with torch only, for the core inference tests.

It has the attribute layout of Hugging Face's Llama (`model.embed_tokens`, `model.layers[i].self_attn.
{q,k,v,o}_proj` with `head_dim`/`scaling`, `mlp.{gate,up,down}_proj`, `input_layernorm`,
`post_attention_layernorm`, `model.norm`, `model.rotary_emb(x, positions) -> (cos, sin)`, `lm_head`) and a
module-level `apply_rotary_pos_emb`, so the engine's fast decode path runs it, while its own `forward`
(full causal attention over the whole sequence, no cache) is the reference the tests compare against.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from tp_models import LlamaMLP


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Rotary(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv)  # persistent: a meta-built model loads it from the checkpoint

    def forward(self, x, positions):
        angles = positions[..., None].float() * self.inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.self_attn = Attention(dim, heads, kv_heads)
        self.mlp = LlamaMLP(dim, hidden)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """`TinyLlama()(ids).logits`: full-sequence logits; `.generation_config` as HF models carry it."""

    def __init__(self, vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, dim)
        self.model.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.model.norm = RMSNorm(dim)
        self.model.rotary_emb = Rotary(dim // heads)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.generation_config = SimpleNamespace(eos_token_id=None, pad_token_id=0, max_length=20)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(x, positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return SimpleNamespace(logits=self.lm_head(self.model.norm(x)))


@torch.no_grad()
def greedy_reference(model, prompt: list[int], new_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy decoding by re-running the full forward for every token (no cache): the slow, obvious way."""
    ids = list(prompt)
    for _ in range(new_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == eos:
            break
    return ids[len(prompt) :]


def train_step(engine, vocab: int, step: int) -> float:
    """One training step of a causal LM engine on this rank's part of a fixed batch (the hybrid-engine tests)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    data = torch.randint(0, vocab, (2, 2, 8), generator=torch.Generator().manual_seed(step))[dist.get_rank()]
    logits = engine(data).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), data[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.item()
