"""Decode paths: how one step of a causal LM runs with a KV cache.

* ``FastDecoder`` runs the submodules of a Llama-style model (Llama, Mistral, Qwen2, and any model with
  the same layout: ``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``, ``mlp``,
  ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``model.rotary_emb``, ``lm_head``)
  directly, with our own caches (kv_cache.py) and ``scaled_dot_product_attention``. It calls the model's own
  modules, so a tensor-parallel split of those linears (module_inject) applies unchanged: head counts are
  read from the local weights. What it skips is the per-step work of the model's generic forward (mask
  building, cache objects, output dataclasses), which dominates at small sizes.
* ``ModelDecoder`` calls the model's own forward with its own cache (``past_key_values``): any Hugging Face
  causal LM (GPT-2, OPT, ...) and correctness first.

Both expose ``prefill(input_ids, attention_mask) -> logits[B, V]`` and ``decode(tokens[B]) -> logits[B, V]``.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F

from .fusion import fuse_linears
from .kv_cache import StaticKVCache

__all__ = ["FastDecoder", "ModelDecoder", "make_decoder"]


def _attention(q, k, v, mask, scale):
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, str):  # "causal": a prompt attending to itself only
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class FastDecoder:
    """A Llama-style model's layers run with our KV caches and SDPA (see module docstring)."""

    @staticmethod
    def supports(model, max_len: int) -> bool:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not len(layers) or not hasattr(model, "lm_head"):
            return False
        if not all(hasattr(inner, name) for name in ("embed_tokens", "norm", "rotary_emb")):
            return False
        layer = layers[0]
        attn = getattr(layer, "self_attn", None)
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        if attn is None or not all(hasattr(attn, name) for name in needed):
            return False
        if not all(hasattr(layer, n) for n in ("mlp", "input_layernorm", "post_attention_layernorm")):
            return False
        if getattr(attn, "sliding_window", None) or getattr(attn, "q_norm", None) is not None:
            return False  # windowed or normed attention: the model's own forward is the reference
        config = getattr(model, "config", None)
        window = getattr(config, "sliding_window", None) if config is not None else None
        if window is not None and getattr(config, "use_sliding_window", True) and window < max_len:
            return False
        return hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")

    def __init__(self, model):
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        # Local (per-rank) head counts come from the weights, so a tensor-parallel split is picked up.
        self.kv_heads = attn.k_proj.weight.shape[0] // self.head_dim
        # Per layer: q/k/v in one matmul and gate/up in one where the modules allow it (fusion.py).
        self.qkv = [
            fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
            for layer in self.layers
        ]
        self.gate_up = [
            fuse_linears([layer.mlp.gate_proj, layer.mlp.up_proj])
            if all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            else None
            for layer in self.layers
        ]
        self.cache: StaticKVCache | None = None
        self._positions: torch.Tensor | None = None

    @property
    def dtype(self):
        return self.embed.weight.dtype

    @property
    def device(self):
        return self.embed.weight.device

    def cache_spec(self) -> dict:
        return dict(num_layers=len(self.layers), kv_heads=self.kv_heads, head_dim=self.head_dim)

    def forward(self, input_ids, positions, cache, last_only: bool = True):
        """Logits for ``input_ids`` [B, T] at ``positions`` [B, T], keys/values going through ``cache``."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, positions)
        batch, steps = input_ids.shape
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            if self.qkv[index] is not None:
                q, k, v = self.qkv[index](x)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.view(batch, steps, -1, self.head_dim).transpose(1, 2)
            k = k.view(batch, steps, -1, self.head_dim).transpose(1, 2)
            v = v.view(batch, steps, -1, self.head_dim).transpose(1, 2)
            q, k = self.apply_rope(q, k, cos, sin)
            k_all, v_all, mask = cache.update(index, k, v)
            out = _attention(q, k_all, v_all, mask, self.scale)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))
            hidden = hidden + self._mlp(index, layer, layer.post_attention_layernorm(hidden))
        if last_only:
            hidden = hidden[:, -1:]
        return self.lm_head(self.norm(hidden))

    def _mlp(self, index: int, layer, x):
        fused = self.gate_up[index]
        if fused is None:
            return layer.mlp(x)
        gate, up = fused(x)
        return layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    # ---- generate's protocol (a fixed batch over a StaticKVCache) ------------------------------------
    def prefill(self, input_ids, attention_mask, max_len: int):
        batch, steps = input_ids.shape
        self.cache = StaticKVCache(batch=batch, max_len=max_len, dtype=self.dtype, device=self.device,
                                   **self.cache_spec())  # fmt: skip
        if attention_mask is None:
            positions = torch.arange(steps, device=input_ids.device).expand(batch, steps)
        else:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        self.cache.begin_step(steps, attention_mask)
        logits = self.forward(input_ids, positions, self.cache)
        self.cache.end_step()
        self._positions = positions[:, -1:] + 1
        return logits[:, -1]

    def decode(self, tokens):
        self.cache.begin_step(1)
        logits = self.forward(tokens[:, None], self._positions, self.cache)
        self.cache.end_step()
        self._positions = self._positions + 1
        return logits[:, -1]

    def release(self) -> None:
        self.cache = None


class ModelDecoder:
    """The model's own forward and cache, stepped by our generation loop (any HF causal LM)."""

    def __init__(self, model):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._past = None
        self._mask = None
        self._positions = None

    def _step(self, input_ids):
        kwargs = dict(attention_mask=self._mask, past_key_values=self._past, use_cache=True)
        if self._takes_positions and self._positions is not None:
            kwargs["position_ids"] = self._positions[:, -input_ids.shape[1] :]
        out = self.model(input_ids=input_ids, **kwargs)
        self._past = out.past_key_values
        return out.logits[:, -1]

    def prefill(self, input_ids, attention_mask, max_len: int):
        self._past = None
        self._mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        self._positions = (self._mask.cumsum(-1) - 1).clamp(min=0)
        return self._step(input_ids)

    def decode(self, tokens):
        batch = tokens.shape[0]
        self._mask = torch.cat([self._mask, self._mask.new_ones(batch, 1)], dim=1)
        self._positions = self._positions[:, -1:] + 1
        return self._step(tokens[:, None])

    def release(self) -> None:
        self._past = self._mask = self._positions = None


def make_decoder(model, max_len: int):
    """The fast path where the model's layout is known, the model's own forward otherwise."""
    return FastDecoder(model) if FastDecoder.supports(model, max_len) else ModelDecoder(model)
