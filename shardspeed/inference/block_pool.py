"""The paged KV cache's block allocator, with prefix caching: full blocks of prompt tokens are shared.

A block is the unit of KV memory (``block_size`` tokens, every layer). ``BlockPool`` hands blocks out and
takes them back. With prefix caching on, a block that holds a *full* block of prompt tokens is also
registered under a key naming its content and everything before it (a hash chain: the key of block ``i``
digests the key of block ``i - 1`` and block ``i``'s token ids), so a later request whose prompt starts with
the same tokens — a chat system prompt — takes those blocks instead of computing their keys and values
again. Shared blocks are counted (``refs``); a registered block nobody uses any more stays cached and is
evicted least-recently-released first, only when a fresh block is needed and no never-used one is left.

Only full blocks are shared, and only ones a sequence never writes again: a sequence always computes at
least its last prompt token itself (its logits are needed) and writes new tokens only past its prompt.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

__all__ = ["BlockPool", "CacheFull", "prefix_keys"]


class CacheFull(RuntimeError):
    """The cache has no room for the tokens a step wants to write."""


def prefix_keys(token_ids: list[int], block_size: int) -> list[bytes]:
    """One key per full block of ``token_ids``: a digest of the previous key and the block's ids."""
    keys, previous = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        keys.append(previous)
    return keys


class BlockPool:
    """``num_blocks`` block ids: free, in use (with a reference count), or cached (registered, unused)."""

    def __init__(self, num_blocks: int, caching: bool = False):
        self.num_blocks = num_blocks
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))  # holding nothing reusable
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.hit_blocks = 0  # blocks taken from the cache instead of computed (a counter for metrics)

    @property
    def available(self) -> int:
        """Blocks a new sequence can get: never used, or cached and unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def in_use(self) -> int:
        return self.num_blocks - self.available

    @property
    def cached(self) -> int:
        """Registered blocks (in use or not) a later prompt may share."""
        return len(self._key_of)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_key[self._key_of.pop(block)]
        else:
            raise CacheFull(f"KV cache pool exhausted: all {self.num_blocks} blocks are in use")
        self._refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None  # most recently released last
            else:
                self._free.append(block)

    # ---- prefix caching ---------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> tuple[list[int], int]:
        """The cached blocks for the longest run of ``keys`` from the start, and how many are evictable."""
        if not self.caching:
            return [], 0
        blocks = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks, sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, block: int) -> None:
        """Take one more reference to a cached block (found by ``lookup``)."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1
        self.hit_blocks += 1

    def register(self, block: int, key: bytes) -> None:
        """``block`` now holds the full block that ``key`` names: later prompts may share it."""
        if self.caching and key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key
