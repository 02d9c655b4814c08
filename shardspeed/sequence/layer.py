"""`DistributedAttention`: DeepSpeed-Ulysses sequence parallelism around any local attention.

Every rank of a sequence-parallel group holds 1/P of the sequence. Attention needs the whole sequence, so
before it the query, key and value are exchanged (one all-to-all each) from sequence-sharded, all heads, to
whole sequence, H/P heads; the unchanged local attention runs on those heads; one more all-to-all returns its
output to sequence-sharded, all heads. Everything outside attention (projections, MLP, norms) is per token
and runs on the local slice untouched, which is why activation memory per rank falls to about 1/P.

Tensors are [s, b, h, d] (`batch_dim_idx=1`, DeepSpeed's default Megatron layout) or [b, s, h, d]
(`batch_dim_idx=0`); h is the head dimension (index 2) in both. Heads — and key/value heads under GQA — must
be divisible by P; DeepSpeed 0.19.8's uneven-head path is refused (see docs/compatibility.md).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from shardspeed.sequence.comm import all_to_all_swap, check_divisible

__all__ = ["DistributedAttention"]

_HEAD_DIM = 2  # heads are dimension 2 in both layouts DeepSpeed supports


class DistributedAttention(nn.Module):
    """Ulysses attention: `local_attention(q, k, v, *args, **kwargs)` on whole sequences and H/P heads.

    `scatter_idx`/`gather_idx` are DeepSpeed's: with `scatter_idx` 2 (the default) the first all-to-all
    scatters heads and gathers the sequence; `scatter_idx` < 2 reverses the roles (inputs that are already
    head-sharded). `sp_stream` (overlapping the exchanges on a CUDA side stream) is accepted and not used.
    """

    def __init__(self, local_attention: nn.Module, sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream=None, num_kv_heads: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        if num_kv_heads is not None:
            check_divisible(num_kv_heads, "num_kv_heads", dist.get_world_size(sequence_process_group))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int | None = None,
                rotary_pos_emb=None, *args, **kwargs) -> Tensor:  # fmt: skip
        if rotary_pos_emb is not None:
            raise NotImplementedError(
                "DistributedAttention(rotary_pos_emb=...) is not supported: apply the rotary embedding to "
                "query and key before calling (positions are those of the rank's sequence slice)"
            )
        seq_dim = self._sequence_dim(batch_dim_idx)
        if self.scatter_idx >= _HEAD_DIM:  # sequence-sharded in: scatter heads, gather the sequence
            to_heads, to_sequence = (_HEAD_DIM, seq_dim), (seq_dim, _HEAD_DIM)
            degree = dist.get_world_size(self.spg)
            for name, t in (("query", query), ("key", key), ("value", value)):
                check_divisible(t.shape[_HEAD_DIM], f"the number of {name} heads", degree)
        else:  # head-sharded in: the roles swap
            to_heads, to_sequence = (seq_dim, _HEAD_DIM), (_HEAD_DIM, seq_dim)
        q, k, v = (all_to_all_swap(t, *to_heads, self.spg) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return all_to_all_swap(context, *to_sequence, self.spg)

    def _sequence_dim(self, batch_dim_idx: int | None) -> int:
        if batch_dim_idx is None:  # DeepSpeed before 0.14 had no batch_dim_idx: gather_idx named the sequence
            batch_dim_idx = 1 if self.gather_idx == 0 else 0
        if batch_dim_idx not in (0, 1):
            raise ValueError(
                f"DistributedAttention: batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), "
                f"got {batch_dim_idx}"
            )
        return 1 - batch_dim_idx
