"""Which tokens a random-LTD layer keeps, and moving hidden states to and from the kept tokens.

DeepSpeed does this with CUDA kernels (`ops/random_ltd`: `token_sort_`, `token_gather`, `token_scatter_`);
here it is `torch.gather` / `Tensor.scatter` along the sequence dimension, differentiable by autograd:

- `sample_tokens`: for each (layer, sample), `reserved_length` distinct positions drawn uniformly
  (`torch.multinomial` over equal weights, as DeepSpeed draws them) and sorted, so kept tokens keep their
  order;
- `gather_tokens`: the hidden states of the kept positions (the layer runs on these only);
- `scatter_tokens`: the full hidden states with the kept positions replaced by the layer's outputs; the
  dropped tokens pass through unchanged. The gradient of a kept position flows through the layer only, that of
  a dropped one straight through (the sum DeepSpeed's two kernels compute).

`gpt_sample_tokens` / `bert_sample_tokens` are DeepSpeed's names: the decoder's causal mask is cut to the kept
length (a sorted subset keeps causality among itself), the encoder's mask is gathered at the kept rows and
columns, per layer.
"""

from __future__ import annotations

import torch

__all__ = [
    "GatherTokens",
    "ScatterTokens",
    "bert_sample_tokens",
    "gather_tokens",
    "gpt_sample_tokens",
    "sample_tokens",
    "scatter_tokens",
]


def sample_tokens(
    reserved_length: int, seq_length: int, batch_size: int, layers: int = 1, device="cpu"
) -> torch.Tensor:
    """Sorted kept positions, shape [layers, batch_size, reserved_length] (int64)."""
    if not 0 < reserved_length <= seq_length:
        raise ValueError(
            f"random-LTD keeps {reserved_length} of {seq_length} tokens: needs 0 < kept <= length"
        )
    weights = torch.ones((layers * batch_size, seq_length), device=device)
    picked = torch.multinomial(weights, reserved_length)
    return picked.sort(dim=-1).values.reshape(layers, batch_size, reserved_length)


def gpt_sample_tokens(reserved_length, seq_length, batch_size, layers=1, device="cpu", attn_mask=None):
    """Kept positions and the causal mask cut to [.., reserved_length, reserved_length] (None without one)."""
    indices = sample_tokens(reserved_length, seq_length, batch_size, layers, device)
    mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return indices, mask


def bert_sample_tokens(reserved_length, seq_length, batch_size, layers=1, device="cpu", attn_mask=None):
    """Kept positions and, per layer, the mask [batch, heads, kept, kept] of the kept rows and columns."""
    if attn_mask is None:
        raise ValueError("random-LTD with model_type 'encoder' needs the attention mask (model_mask_name)")
    indices = sample_tokens(reserved_length, seq_length, batch_size, layers, device)
    masks = []
    for layer in range(layers):
        rows = torch.stack([attn_mask[b][:, indices[layer, b]] for b in range(batch_size)])
        masks.append(torch.stack([rows[b][:, :, indices[layer, b]] for b in range(batch_size)]))
    return indices, masks


def _expand(indices: torch.Tensor, hidden: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """[batch, kept] positions as a gather/scatter index shaped like the kept hidden states."""
    if batch_first:  # hidden [batch, seq, h]
        return indices.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return indices.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # hidden [seq, batch, h]


def gather_tokens(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The hidden states of the kept positions `indices` [batch, kept]."""
    dim = 1 if batch_first else 0
    return hidden.gather(dim, _expand(indices.long(), hidden, batch_first))


def scatter_tokens(
    hidden: torch.Tensor, kept: torch.Tensor, indices: torch.Tensor, batch_first: bool
) -> torch.Tensor:
    """`hidden` with the kept positions replaced by `kept` (a new tensor; `hidden` is not changed)."""
    dim = 1 if batch_first else 0
    return hidden.scatter(dim, _expand(indices.long(), hidden, batch_first), kept.to(hidden.dtype))


class GatherTokens:
    """DeepSpeed's autograd function, as a name: `apply(hidden, indices, batch_first)` -> (hidden, kept)."""

    @staticmethod
    def apply(activations: torch.Tensor, sorted_indices: torch.Tensor, batch_first: bool):
        return activations, gather_tokens(activations, sorted_indices, batch_first)


class ScatterTokens:
    """DeepSpeed's autograd function, as a name: `apply(hidden, kept, indices, batch_first)` -> hidden."""

    @staticmethod
    def apply(all_activations, layer_activations, sorted_indices, batch_first: bool):
        return scatter_tokens(all_activations, layer_activations, sorted_indices, batch_first)
