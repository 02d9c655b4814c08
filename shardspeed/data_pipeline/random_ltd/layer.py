"""`RandomLayerTokenDrop`: a layer wrapper that runs the layer on a random subset of the tokens (random-LTD).

Random layerwise token dropping (https://arxiv.org/abs/2211.11586): in training, each wrapped layer processes
only `scheduler.get_current_seq()` of the sequence's tokens, drawn at random per sample; the dropped tokens
skip the layer unchanged. The first dropping layer of a forward draws the positions for all dropping layers
(one draw per layer) and leaves them, with the cut attention mask, on the scheduler for the others. In eval
mode, before `init_config`, or when the schedule keeps the whole sequence, the layer runs as it is.

`init_config` is called by the engine (`engine.random_ltd_initialize()`, which `convert_to_random_ltd`
calls) with the `random_ltd` block, the engine's scheduler and the layer's place among the dropping layers.
"""

from __future__ import annotations

import torch
from torch import nn

from .tokens import bert_sample_tokens, gather_tokens, gpt_sample_tokens, scatter_tokens

__all__ = ["RandomLayerTokenDrop"]


class RandomLayerTokenDrop(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler = None
        self.random_ltd_layer_id = None
        self.max_length = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.curr_micro_batch = -1
        self.batch_first = False

    def init_config(self, config, scheduler, random_ltd_layer_id: int) -> None:
        """Attach the engine's scheduler; `config` is the `random_ltd` block (typed, or DeepSpeed's dict)."""
        get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state["max_value"]
        self.mask_name = get("model_mask_name")
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.model_type = get("model_type")
        order = get("hidden_state_order")
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(
                f"random_ltd hidden_state_order: 'batch_seq_dim' or 'seq_batch_dim', got {order!r}"
            )
        if self.model_type not in ("encoder", "decoder"):
            raise ValueError(f"random_ltd model_type: 'encoder' or 'decoder', got {self.model_type!r}")
        self.batch_first = order == "batch_seq_dim"
        self.index_generator = bert_sample_tokens if self.model_type == "encoder" else gpt_sample_tokens

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        scheduler = self.random_ltd_scheduler
        if scheduler is None:
            return self.random_ltd_layer(hidden_states, **kwargs)
        self.reserved_length = scheduler.get_current_seq()
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        self.curr_seq, self.curr_micro_batch = hidden_states.shape[seq_dim], hidden_states.shape[batch_dim]
        if not self.training or self.reserved_length >= self.curr_seq:
            return self.random_ltd_layer(hidden_states, **kwargs)
        if self.random_ltd_layer_id == 0:  # the first dropping layer draws for all of them
            mask = kwargs.get(self.mask_name) if self.mask_name is not None else None
            indices, cut_mask = self.index_generator(
                self.reserved_length, self.curr_seq, self.curr_micro_batch, self.random_ltd_num_layer,
                hidden_states.device, mask,
            )  # fmt: skip
            scheduler.state["sample_idx"], scheduler.state["attention_mask"] = indices, cut_mask
        indices = scheduler.state["sample_idx"][self.random_ltd_layer_id]
        cut_mask = scheduler.state["attention_mask"]
        if self.mask_name is not None:
            kwargs[self.mask_name] = (
                cut_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else cut_mask
            )
        outputs = self.random_ltd_layer(gather_tokens(hidden_states, indices, self.batch_first), **kwargs)
        if isinstance(outputs, torch.Tensor):
            return scatter_tokens(hidden_states, outputs, indices, self.batch_first)
        if isinstance(outputs, tuple):
            return (scatter_tokens(hidden_states, outputs[0], indices, self.batch_first), *outputs[1:])
        raise TypeError(
            f"random-LTD: the wrapped {type(self.random_ltd_layer).__name__} returned {type(outputs).__name__}; "
            "a layer must return a tensor or a tuple whose first element is the hidden states"
        )
