"""Decode paths: how one step of a causal LM runs with a KV cache.

* ``FastDecoder`` runs the submodules of a Llama-style model (Llama, Mistral, Qwen2, and any model with
  the same layout: ``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``, ``mlp``,
  ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``model.rotary_emb``, ``lm_head``)
  directly, with our own caches (kv_cache.py) and ``scaled_dot_product_attention``. It calls the model's own
  modules, so a tensor-parallel split of those linears (module_inject) applies unchanged: head counts are
  read from the local weights. What it skips is the per-step work of the model's generic forward (mask
  building, cache objects, output dataclasses), which dominates at small sizes. More per-token savings,
  each checked once against the model's own function to give the same numbers bit for bit (else the
  model's function is used): rotary cos/sin are looked up in a table built once (for position-independent
  RoPE types); RoPE is applied to q and k together, straight on the fused q/k/v output, as
  ``x * cos + swap(x) * sin'`` (``swap`` exchanges the two halves of the last dimension, ``sin'`` = sin with
  its first half negated: ``rotate_half`` without its negation); RMSNorm is one fused ``F.rms_norm`` with
  the weight applied inside where that gives the module's numbers.
* ``ModelDecoder`` calls the model's own forward with its own cache (``past_key_values``): any Hugging Face
  causal LM (GPT-2, OPT, ...) and correctness first.

Both expose ``prefill(input_ids, attention_mask) -> logits[B, V]`` and ``decode(tokens[B]) -> logits[B, V]``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fusion import FusedLinear, fuse_linears, fused_copy
from .kv_cache import StaticKVCache

__all__ = ["FastDecoder", "LayerParts", "ModelDecoder", "make_decoder"]

# RoPE variants whose cos/sin depend on the position only (not on the sequence length seen so far).
_STATIC_ROPE = {"default", "linear", "llama3"}


def _direct(module):
    """A plain ``nn.Linear`` or SiLU as a direct functional call (no module dispatch per token), else the module.

    The weight is read at each call, so weights replaced later (``.to(dtype)``, a new state dict) are used.
    """
    if type(module) is torch.nn.Linear:
        return lambda x: F.linear(x, module.weight, module.bias)
    if type(module) is torch.nn.SiLU or type(module).__name__ == "SiLUActivation":
        return F.silu
    return module


def _signed(sin):
    """sin with the first half of its last dimension negated (``rotate_half``'s sign, folded in)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rms_norm(module, weight: torch.Tensor | None = None):
    """A fused equivalent of a Hugging Face RMSNorm module (normalise in fp32, cast, scale), else the module.

    ``weight``: scale by this tensor (a copy of the module's, made while it was whole: tensor-parallel
    rollouts, whose modules are released under ZeRO-3) instead of reading ``module.weight`` at each call.
    """
    eps, own = getattr(module, "variance_epsilon", None), getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNorm") or eps is None or own is None:
        return module
    scale = (lambda: module.weight) if weight is None else (lambda: weight)

    def scaled_inside(x):
        # one op: the weight is applied inside the fused kernel (equal where x is already fp32)
        return F.rms_norm(x, (x.shape[-1],), scale(), eps)

    def scaled_after(x):
        return scale() * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    # Only where it gives the module's own numbers, bit for bit (a model's RMSNorm may differ: 1 + weight,
    # a 16-bit cast before scaling, ...); the first form that does is used
    with torch.no_grad():
        probe = torch.randn(3, own.shape[-1], generator=torch.Generator().manual_seed(0)).to(own)
        want = module(probe)
        for norm in (scaled_inside, scaled_after):
            if torch.equal(norm(probe), want):
                return norm
        return module


@dataclass
class LayerParts:
    """One decoder layer's weights held by the decoder itself rather than read from the model's modules
    (tp_rollout.py: this rank's tensor-parallel shards, made while the layer was gathered). Each is a
    callable on the hidden states; ``qkv`` and ``gate_up`` are ``FusedLinear``s over this rank's heads and
    columns, ``o_proj`` and ``down_proj`` sum their partial products over the tensor group."""

    qkv: FusedLinear
    o_proj: Callable
    gate_up: FusedLinear
    down_proj: Callable
    act_fn: Callable
    input_norm: Callable
    post_norm: Callable


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

    def __init__(
        self, model, fuse: bool = True, fuse_copies: bool = False, parts: list[LayerParts] | None = None
    ):
        """``fuse=False`` leaves the model's parameters as they are (a training model's, which an optimizer
        and ZeRO hold by identity): q/k/v and gate/up then run as separate matmuls, each reading its weight
        at the call; with ``fuse_copies`` they run fused from copies of the weights made now, which live as
        long as this decoder (the hybrid engine builds one per ``generate`` call). ``parts``: every layer's
        weights made elsewhere (``LayerParts``); the layers' own modules are then never called."""
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
        self.cache: StaticKVCache | None = None
        self.keep_cache = False  # True: release() keeps the cache for the next prefill of the same shape
        self._positions: torch.Tensor | None = None
        self.final_norm = _rms_norm(self.norm)
        self.head = _direct(self.lm_head)
        self._rope_table: tuple | None = None  # (dtype, device, cos, sin, signed sin), each [max_len, dim]
        if parts is not None:
            self._take_parts(parts)
        else:
            self._read_layers(fuse_linears if fuse else fused_copy if fuse_copies else None)
        self.joint_rope = all(f is not None for f in self.qkv) and self._joint_rope_matches()

    def _read_layers(self, fusing) -> None:
        # Local (per-rank) head counts come from the weights, so a tensor-parallel split is picked up.
        self.kv_heads = self.layers[0].self_attn.k_proj.weight.shape[0] // self.head_dim
        # Per layer: q/k/v in one matmul and gate/up in one where the modules allow it (fusion.py).
        self.qkv = [
            fusing([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
            if fusing
            else None
            for layer in self.layers
        ]
        self.gate_up = [
            fusing([layer.mlp.gate_proj, layer.mlp.up_proj])
            if fusing and all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            else None
            for layer in self.layers
        ]
        self.input_norms = [_rms_norm(layer.input_layernorm) for layer in self.layers]
        self.post_norms = [_rms_norm(layer.post_attention_layernorm) for layer in self.layers]
        self.o_proj = [_direct(layer.self_attn.o_proj) for layer in self.layers]
        self.down_proj = [_direct(getattr(layer.mlp, "down_proj", None)) for layer in self.layers]
        self.act_fn = [_direct(getattr(layer.mlp, "act_fn", None)) for layer in self.layers]

    def _take_parts(self, parts: list[LayerParts]) -> None:
        self.kv_heads = parts[0].qkv.sizes[1] // self.head_dim
        self.qkv = [p.qkv for p in parts]
        self.gate_up = [p.gate_up for p in parts]
        self.input_norms = [p.input_norm for p in parts]
        self.post_norms = [p.post_norm for p in parts]
        self.o_proj = [p.o_proj for p in parts]
        self.down_proj = [p.down_proj for p in parts]
        self.act_fn = [p.act_fn for p in parts]

    @property
    def dtype(self):
        return self.embed.weight.dtype

    @property
    def device(self):
        return self.embed.weight.device

    def cache_spec(self) -> dict:
        return dict(num_layers=len(self.layers), kv_heads=self.kv_heads, head_dim=self.head_dim)

    def _cos_sin(self, hidden, positions, max_len: int):
        """Rotary (cos, sin, signed sin) at ``positions``; from a table when they depend on the position only."""
        if getattr(self.rotary, "rope_type", None) not in _STATIC_ROPE:
            cos, sin = self.rotary(hidden, positions)
            return cos, sin, _signed(sin)
        table = self._rope_table
        if table is None or table[:2] != (hidden.dtype, hidden.device) or table[2].shape[0] < max_len:
            cos, sin = self.rotary(hidden, torch.arange(max_len, device=hidden.device)[None])
            table = self._rope_table = (hidden.dtype, hidden.device, cos[0], sin[0], _signed(sin[0]))
        return table[2][positions], table[3][positions], table[4][positions]

    @staticmethod
    def _rope(x, cos, signed_sin):
        """``x * cos + rotate_half(x) * sin`` for x [B, T, heads, D], without rotate_half's negation.

        The halves are swapped with one ``cat`` of two views: ``roll`` gives the same values through a
        dozen dispatched ops, which at batch 1 cost more than the arithmetic."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin

    @torch.no_grad()
    def _joint_rope_matches(self) -> bool:
        """Whether ``_rope`` gives the model's own ``apply_rotary_pos_emb`` numbers, bit for bit."""
        weight = self.embed.weight
        if weight.device.type == "meta":
            return False
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, 2, 3, self.head_dim, generator=g).to(weight) for _ in range(2))  # [B, H, T, D]
        hidden = torch.zeros(1, 3, 1, dtype=weight.dtype, device=weight.device)
        cos, sin = self.rotary(hidden, torch.arange(3, device=weight.device)[None] + 5)
        want_q, want_k = self.apply_rope(q, k, cos, sin)
        cos4, sin4 = cos[:, :, None], _signed(sin)[:, :, None]
        got_q = self._rope(q.transpose(1, 2), cos4, sin4).transpose(1, 2)
        got_k = self._rope(k.transpose(1, 2), cos4, sin4).transpose(1, 2)
        return torch.equal(got_q, want_q) and torch.equal(got_k, want_k)

    def _attention_inputs(self, index: int, layer, x, rope):
        """q, k, v [B, heads, T, D] for layer ``index``, RoPE applied."""
        batch, steps = x.shape[:2]
        cos, sin, signed_sin = rope
        if self.joint_rope:
            fused = self.qkv[index]
            q_heads, k_heads = fused.sizes[0] // self.head_dim, fused.sizes[1] // self.head_dim
            qkv = fused.joint(x).view(batch, steps, -1, self.head_dim)  # [B, T, q + k + v heads, D]
            qk = self._rope(qkv[:, :, : q_heads + k_heads], cos[:, :, None], signed_sin[:, :, None])
            v = qkv[:, :, q_heads + k_heads :]
            return qk[:, :, :q_heads].transpose(1, 2), qk[:, :, q_heads:].transpose(1, 2), v.transpose(1, 2)
        attn = layer.self_attn
        if self.qkv[index] is not None:
            q, k, v = self.qkv[index](x)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.view(batch, steps, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, steps, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, steps, -1, self.head_dim).transpose(1, 2)
        q, k = self.apply_rope(q, k, cos, sin)
        return q, k, v

    def forward(self, input_ids, positions, cache, last_only: bool = True):
        """Logits for ``input_ids`` [B, T] at ``positions`` [B, T], keys/values going through ``cache``."""
        hidden = self.embed(input_ids)
        rope = self._cos_sin(hidden, positions, cache.max_len)
        batch, steps = input_ids.shape
        for index, layer in enumerate(self.layers):
            q, k, v = self._attention_inputs(index, layer, self.input_norms[index](hidden), rope)
            k_all, v_all, mask = cache.update(index, k, v)
            out = _attention(q, k_all, v_all, mask, self.scale)
            hidden = hidden + self.o_proj[index](out.transpose(1, 2).reshape(batch, steps, -1))
            hidden = hidden + self._mlp(index, layer, self.post_norms[index](hidden))
        if last_only:
            hidden = hidden[:, -1:]
        return self.head(self.final_norm(hidden))

    def _mlp(self, index: int, layer, x):
        fused = self.gate_up[index]
        if fused is None:
            return layer.mlp(x)
        gate, up = fused(x)
        return self.down_proj[index](self.act_fn[index](gate) * up)

    # ---- generate's protocol (a fixed batch over a StaticKVCache) ------------------------------------
    def prefill(self, input_ids, attention_mask, max_len: int):
        batch, steps = input_ids.shape
        kept = self.cache
        if kept is not None and kept.fits(batch, max_len, self.dtype, self.device, **self.cache_spec()):
            kept.reset()
        else:
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
        if not self.keep_cache:
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
