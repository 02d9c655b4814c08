"""Key/value caches the decoder writes each step's keys and values into.

Both caches answer one question per attention layer: "here are this step's keys and values; give me every
key and value the queries may see, and the mask". The decoder (decoder.py) does not know which one it has.

* ``StaticKVCache``: one preallocated buffer per layer, ``[batch, kv_heads, max_len, head_dim]``, for
  ``generate`` on a fixed batch (rows may be left-padded: ``key_valid`` marks real tokens). Nothing is
  allocated while decoding; a step reads the prefix ``[:length]``, so the per-token cost is the attention
  itself, with no Python work that grows with the sequence.
* ``PagedKVCache``: a pool of fixed-size blocks shared by many sequences (the server's continuous batching):
  a sequence owns a list of blocks, grows one block at a time and hands its blocks back the moment it ends,
  so requests of different lengths share memory without reserving ``max_len`` each. With prefix caching
  (block_pool.py) sequences whose prompts start alike share the blocks of that common start.
"""

from __future__ import annotations

import torch

from .block_pool import BlockPool, CacheFull, prefix_keys

__all__ = ["CacheFull", "PagedKVCache", "PagedSequence", "StaticKVCache"]


class StaticKVCache:
    """Preallocated keys/values for a fixed batch; every row advances by the same number of tokens."""

    def __init__(self, *, num_layers, batch, kv_heads, head_dim, max_len, dtype, device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0
        self.key_valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self._mask: torch.Tensor | None = None
        self._step = 0
        self._has_padding = False

    def fits(self, batch, max_len, dtype, device, *, num_layers, kv_heads, head_dim) -> bool:
        """Whether a generate of this shape can reuse this cache (the hybrid engine keeps one between calls)."""
        keys = self.keys[0] if self.keys else None
        shape = (batch, kv_heads, max_len, head_dim)
        return (
            keys is not None and len(self.keys) == num_layers and tuple(keys.shape) == shape
            and keys.dtype == dtype and keys.device == torch.device(device)
        )  # fmt: skip

    def reset(self) -> None:
        """Empty the cache for a new batch, keeping its buffers (stale keys are never read: ``length`` is 0)."""
        self.length = 0
        self.key_valid.fill_(True)
        self._mask = None
        self._step = 0
        self._has_padding = False

    def begin_step(self, num_tokens: int, padding_mask: torch.Tensor | None = None) -> None:
        """Announce a step of ``num_tokens`` per row; ``padding_mask`` [batch, num_tokens] marks real tokens."""
        start, end = self.length, self.length + num_tokens
        if end > self.max_len:
            raise CacheFull(
                f"sequence would reach {end} tokens but the KV cache holds {self.max_len} "
                f"(raise max_out_tokens)"
            )
        if padding_mask is not None:
            self.key_valid[:, start:end] = padding_mask.to(torch.bool)
            # one host sync per batch, at prefill: later unpadded steps skip the mask entirely
            self._has_padding = self._has_padding or not bool(padding_mask.all())
        self._step = num_tokens
        if num_tokens == 1 and not self._has_padding:
            self._mask = None  # one query sees every key: SDPA's unmasked fast path
            return
        if start == 0 and not self._has_padding:
            # an unpadded prompt sees only itself: SDPA's causal kernel, as Hugging Face's own forward
            # uses, instead of building and reading a [batch, 1, T, T] mask
            self._mask = "causal"
            return
        device = self.key_valid.device
        query_pos = torch.arange(start, end, device=device)[:, None]
        key_pos = torch.arange(end, device=device)[None, :]
        causal = key_pos <= query_pos  # [T, end]
        # Every query also sees its own key: a padding query would otherwise see nothing (a NaN row).
        own = key_pos == query_pos
        self._mask = (causal[None, None] & self.key_valid[:, None, None, :end]) | own[None, None]

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        start, end = self.length, self.length + self._step
        self.keys[layer][:, :, start:end] = keys
        self.values[layer][:, :, start:end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end], self._mask

    def end_step(self) -> None:
        self.length += self._step


class PagedSequence:
    """One sequence's share of a ``PagedKVCache``: its blocks (a preallocated table row) and its length."""

    def __init__(self, max_blocks: int, device):
        self.block_table = torch.zeros(max_blocks, dtype=torch.long, device=device)
        self.blocks: list[int] = []
        self.length = 0
        self.cached_tokens = 0  # prompt tokens whose keys/values came from the prefix cache


class PagedKVCache:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens per layer, shared by many sequences.

    A step is either the prefill of one new sequence (its prompt, or the part of it past a cached prefix)
    or one decode token for each of a batch of sequences of different lengths. Reads gather each
    sequence's blocks into a padded view with a mask of its valid positions.
    """

    def __init__(self, *, num_layers, kv_heads, head_dim, num_blocks, block_size, max_len, dtype, device,
                 prefix_caching: bool = False):  # fmt: skip
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_len = max_len
        self.max_blocks = -(-max_len // block_size)
        self.device = device
        self.pool = BlockPool(num_blocks, caching=prefix_caching)
        self._plan: tuple | None = None

    # ---- ownership --------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks a new sequence can claim (cached blocks nobody uses count: they are evicted on demand)."""
        return self.pool.available

    @property
    def prefix_caching(self) -> bool:
        return self.pool.caching

    def new_sequence(self) -> PagedSequence:
        return PagedSequence(self.max_blocks, self.device)

    def release(self, seq: PagedSequence) -> None:
        """Give a finished (or abandoned) sequence's blocks back to the pool."""
        for block in reversed(seq.blocks):
            self.pool.release(block)
        seq.blocks.clear()
        seq.length = 0

    def prompt_keys(self, prompt_ids: list[int]) -> list[bytes]:
        """Keys of the prompt's full blocks (empty when prefix caching is off)."""
        return prefix_keys(prompt_ids, self.block_size) if self.prefix_caching else []

    def reusable(self, prompt_ids: list[int], keys: list[bytes]) -> tuple[list[int], int]:
        """Cached blocks this prompt can share, and how many of them are evictable now.

        At most ``len(prompt) - 1`` tokens: the last prompt token is always computed, for its logits.
        """
        return self.pool.lookup(keys[: (len(prompt_ids) - 1) // self.block_size])

    def share_prefix(self, seq: PagedSequence, blocks: list[int]) -> None:
        """Start a new sequence on cached ``blocks`` (from ``reusable``): its prompt prefill starts after them."""
        if seq.length or seq.blocks:
            raise ValueError("a cached prefix starts a new sequence (length 0)")
        for block in blocks:
            self.pool.share(block)
            seq.block_table[len(seq.blocks)] = block
            seq.blocks.append(block)
        seq.length = seq.cached_tokens = len(blocks) * self.block_size

    def register_prompt(self, seq: PagedSequence, keys: list[bytes]) -> None:
        """After its prefill: the sequence's full prompt blocks become shareable."""
        for block, key in zip(seq.blocks, keys):
            self.pool.register(block, key)

    def blocks_needed(self, seq: PagedSequence, num_tokens: int) -> int:
        return max(0, -(-(seq.length + num_tokens) // self.block_size) - len(seq.blocks))

    def _reserve(self, seq: PagedSequence, num_tokens: int) -> None:
        if seq.length + num_tokens > self.max_len:
            raise CacheFull(f"sequence would reach {seq.length + num_tokens} tokens, limit {self.max_len}")
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.pool.available:
            raise CacheFull(f"KV cache pool exhausted: {needed} blocks needed, {self.pool.available} free")
        for _ in range(needed):
            block = self.pool.allocate()
            seq.block_table[len(seq.blocks)] = block
            seq.blocks.append(block)

    # ---- steps ------------------------------------------------------------------------------------
    def begin_prefill(self, seq: PagedSequence, num_tokens: int) -> None:
        """A sequence's prompt (past any cached prefix): causal over itself and the prefix, written to blocks."""
        start = seq.length
        self._reserve(seq, num_tokens)
        positions = torch.arange(start, start + num_tokens, device=self.device)
        slots = seq.block_table[positions // self.block_size]
        prefix = None
        if start:  # queries see the cached prefix too: an explicit causal mask, offset by the prefix
            used = -(-(start + num_tokens) // self.block_size)
            keys = torch.arange(start + num_tokens, device=self.device)
            mask = keys[None, :] <= positions[:, None]
            prefix = (seq.block_table[:used], start + num_tokens, mask[None, None])
        self._plan = ("prefill", [seq], slots, positions % self.block_size, (num_tokens, prefix))

    def begin_decode(self, seqs: list[PagedSequence]) -> None:
        """One new token for each sequence in ``seqs`` (of any lengths)."""
        for seq in seqs:
            self._reserve(seq, 1)
        lengths = torch.tensor([seq.length for seq in seqs], device=self.device)
        tables = torch.stack([seq.block_table for seq in seqs])  # [B, max_blocks]
        rows = torch.arange(len(seqs), device=self.device)
        slots = tables[rows, lengths // self.block_size]
        # Read only as many blocks as the longest sequence uses, not the whole table.
        used = -(-(int(lengths.max()) + 1) // self.block_size)
        tables = tables[:, :used]
        valid = torch.arange(used * self.block_size, device=self.device)[None, :] <= lengths[:, None]
        self._plan = ("decode", seqs, slots, lengths % self.block_size, (tables, valid[:, None, None, :]))

    def _gather(self, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """[B, used] block ids -> [B, H, used * block_size, D] keys or values, in position order."""
        batch, used = tables.shape
        gathered = pool[tables]  # [B, used, H, bs, D]
        return gathered.permute(0, 2, 1, 3, 4).reshape(batch, pool.shape[1], used * self.block_size, -1)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        kind, _, slots, offsets, extra = self._plan
        pool_k, pool_v = self.keys[layer], self.values[layer]
        if kind == "prefill":
            # keys: [1, H, T, D] -> pool[slot_t, :, offset_t] for every t
            pool_k[slots, :, offsets] = keys[0].transpose(0, 1)
            pool_v[slots, :, offsets] = values[0].transpose(0, 1)
            prefix = extra[1]
            if prefix is None:
                return keys, values, "causal"
            table, end, mask = prefix
            k_all = self._gather(pool_k, table[None])[:, :, :end]
            v_all = self._gather(pool_v, table[None])[:, :, :end]
            return k_all, v_all, mask
        pool_k[slots, :, offsets] = keys[:, :, 0]
        pool_v[slots, :, offsets] = values[:, :, 0]
        tables, mask = extra
        return self._gather(pool_k, tables), self._gather(pool_v, tables), mask

    def end_step(self) -> None:
        kind, seqs, _, _, extra = self._plan
        if kind == "prefill":
            seqs[0].length += extra[0]
        else:
            for seq in seqs:
                seq.length += 1
        self._plan = None

    def abort_step(self) -> None:
        """Forget a step whose forward failed: lengths stay; blocks it reserved stay with their sequences."""
        self._plan = None
