"""`UlyssesSPAttentionHF`: Ulysses sequence parallelism around a Hugging Face attention function (ALST).

Hugging Face models call their attention through `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` as
`attn(module, query, key, value, attention_mask, **kwargs) -> (output, weights)` with query/key/value
[batch, heads, local sequence, head size]. `register_with_transformers` (hf_register.py) puts a wrapper
under that key, so every attention layer of the model goes through `UlyssesSPAttentionHF.forward`:

1. key/value heads are repeated when there are fewer than ranks (MQA, small GQA), so each rank gets one;
2. one all-to-all each for query, key and value (shardspeed.sequence.comm): [b, H, s/P, d] -> [b, H/P, s, d];
3. the position ids of the P slices are gathered, so the core attention sees the whole sequence's positions;
4. the original attention runs on whole sequences of H/P heads — causal through `is_causal`, since the
   wrapper drops the 4D mask the model built for its local slice (DeepSpeed does the same: such a mask is
   O(s^2) memory and wrong for the gathered sequence);
5. one all-to-all brings its output back to [b, s/P, H x d].

The model outside attention (embeddings, projections, MLP, norms, loss) is per token and sees only its
slice. Shapes are checked against the batch size, head counts and, unless `seq_length_is_variable`, the
sequence length given at construction, as DeepSpeed checks them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from shardspeed.sequence.comm import all_to_all_swap

__all__ = ["UlyssesSPAttentionHF"]

_HEADS, _SEQ = 1, 2  # dimensions of HF's [batch, heads, sequence, head size]


class UlyssesSPAttentionHF(torch.nn.Module):
    """DeepSpeed 0.19.8's arguments: `attn` the core attention function (from `ALL_ATTENTION_FUNCTIONS`),
    the micro-batch size, head counts and size, `num_hidden_layers` (only for the debug mode below), the
    sequence-parallel `process_group`; `seq_length_is_variable` or the fixed `local_seq_length` /
    `global_seq_length`; `disable_in_eval` runs the core attention unchanged when the module is in eval mode.

    `skip_all_but_last_attention_debug_mode = True` (DeepSpeed's memory-probing aid) skips the core attention
    in all but every `num_hidden_layers`-th call, returning the query in its place: the loss is garbage.
    """

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.skip_all_but_last_attention_debug_mode = False
        self.rotating_layer_counter = 0
        self.core_attn_implementation = None  # set by register_with_transformers

        if attn_head_count % self.world_size != 0:
            raise ValueError(
                f"Attention head count {attn_head_count} is not divisible by SP size {self.world_size}"
            )
        if kv_head_count % self.world_size != 0 and self.world_size % kv_head_count != 0:
            raise ValueError(
                f"KV attention head count {kv_head_count} is not divisible by SP size {self.world_size} or vice versa"
            )
        if not seq_length_is_variable and (local_seq_length is None or global_seq_length is None):
            raise ValueError(
                "local_seq_length and global_seq_length are required when seq_length_is_variable is False"
            )
        self.local_q_head_count = attn_head_count // self.world_size
        # Fewer key/value heads than ranks (4 kv heads, sp 8): each is repeated so that every rank gets one
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Tensor | None, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        local_len = query.shape[_SEQ]
        if self.seq_length_is_variable:
            self.local_seq_length, self.global_seq_length = local_len, local_len * self.world_size
        self._check_shapes(query, key, value)
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError(
                "Ulysses SP requires position_ids in every forward() call: after the all-to-all the core attention "
                "sees the whole sequence, and without them each rank's positions restart at 0 (which reads as "
                "packed sequences). For non-packed sequences: position_ids = torch.arange(seq_len) per sample; "
                "UlyssesSPDataLoaderAdapter keeps the batch's position_ids."
            )
        kwargs["position_ids"] = self._gather_sequence(kwargs["position_ids"])

        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=_HEADS)
            value = value.repeat_interleave(self.kv_replication_factor, dim=_HEADS)
            # the core attention repeats kv heads by this factor (GQA): locally it is now H/P : 1
            module.num_key_value_groups = self.local_q_head_count
        q, k, v = (all_to_all_swap(t, _HEADS, _SEQ, self.process_group) for t in (query, key, value))

        if self._skip_this_layer():
            context, weights = q.transpose(1, 2), None  # [b, s, H/P, d] of the right shape, wrong values
        else:
            context, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)
        # HF's attention functions return [b, s, H/P, d]: back to this rank's slice with every head
        context = all_to_all_swap(context, 1, 2, self.process_group)  # [b, s/P, H, d]
        return context.reshape(*context.shape[:2], -1), weights

    def _check_shapes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        want_q = (self.batch_size, self.attn_head_count, self.local_seq_length, self.attn_head_size)
        want_kv = (self.batch_size, self.global_kv_head_count, self.local_seq_length, self.attn_head_size)
        if tuple(query.shape) != want_q or tuple(key.shape) != want_kv or tuple(value.shape) != want_kv:
            raise ValueError(
                f"UlyssesSPAttentionHF on rank {dist.get_rank()}: expected query {want_q} and key/value {want_kv} "
                f"([batch, heads, local sequence, head size]), got query {tuple(query.shape)}, key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}"
            )

    def _gather_sequence(self, local: Tensor) -> Tensor:
        """[b, s/P] from every rank of the group -> [b, s] in rank order (no gradient: position ids)."""
        pieces = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(pieces, local.contiguous(), group=self.process_group)
        return torch.cat(pieces, dim=1)

    def _skip_this_layer(self) -> bool:
        if not self.skip_all_but_last_attention_debug_mode:
            return False
        self.rotating_layer_counter = (self.rotating_layer_counter + 1) % self.num_hidden_layers
        return self.rotating_layer_counter != 0

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None):  # fmt: skip
        """Put Ulysses around `core_attn_implementation` in Transformers' attention registry; return the mpu
        (the `parallel_state_sp` module) to pass to `deepspeed.initialize`, or None when the size is 1."""
        from shardspeed.sequence.hf_register import register_with_transformers

        return register_with_transformers(
            cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, micro_batch_size,
            seq_length=seq_length, seq_length_is_variable=seq_length_is_variable, disable_in_eval=disable_in_eval,
            max_length=max_length,
        )  # fmt: skip
