"""Continuous batching: many requests of different lengths decoded together over a paged KV cache.

``ContinuousBatcher.step()`` is one scheduling round:
  1. requests cancelled since the last round (a client went away) leave and free their blocks;
  2. waiting requests join while there is a batch slot and KV blocks for their whole budget (prompt +
     ``max_new_tokens``, so a running request can never run out of blocks half-way): each is prefilled on
     its own (its prompt attends only to itself) and emits its first token;
  3. one decode step over every running request, whatever its length (the paged cache masks each row to
     its own length); a request that hits a stop token or its budget leaves at once.
New requests therefore join between decode steps and finished ones never wait for the rest of a batch.
Tokens go out through each request's ``emit(token, finish_reason)`` callback (finish_reason None while
running, "stop" or "length" on the last call, "cancelled" never emitted). The batcher is not thread-safe
by itself: ``submit`` and ``cancel`` only append to queues; one thread calls ``step``.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .generation import GenerationSettings, next_tokens
from .kv_cache import PagedKVCache, PagedSequence

__all__ = ["BatchRequest", "ContinuousBatcher"]

_ids = itertools.count()


@dataclass(eq=False)
class BatchRequest:
    """One prompt's generation, as the batcher tracks it."""

    prompt_ids: list[int]
    settings: GenerationSettings
    emit: Callable[[int, str | None], None]
    seed: int | None = None
    id: int = field(default_factory=lambda: next(_ids))
    generated: list[int] = field(default_factory=list)
    seq: PagedSequence | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None


class ContinuousBatcher:
    """Schedules ``BatchRequest``s over a ``FastDecoder`` and a ``PagedKVCache`` (see module docstring)."""

    def __init__(self, decoder, *, max_len: int, max_batch: int = 32, block_size: int = 16, num_blocks=None):
        if not hasattr(decoder, "cache_spec"):
            raise ValueError(
                f"continuous batching needs a Llama-style model (Llama, Mistral, Qwen2); this model runs "
                f"through {type(decoder).__name__} (use engine.generate)"
            )
        self.decoder = decoder
        self.max_len = max_len
        self.max_batch = max_batch
        blocks_per_seq = -(-max_len // block_size)
        self.cache = PagedKVCache(
            num_blocks=num_blocks or max_batch * blocks_per_seq, block_size=block_size, max_len=max_len,
            dtype=decoder.dtype, device=decoder.device, **decoder.cache_spec(),
        )  # fmt: skip
        self.waiting: collections.deque[BatchRequest] = collections.deque()
        self.running: list[BatchRequest] = []
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.steps = 0
        self.max_running_seen = 0
        self.cancelled_count = 0

    # ---- called from any thread ---------------------------------------------------------------------
    def submit(self, request: BatchRequest) -> None:
        total = len(request.prompt_ids) + request.settings.max_new_tokens
        if not request.prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        if total > self.max_len:
            raise ValueError(
                f"max_tokens: prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                f"({request.settings.max_new_tokens}) exceeds the model's context of {self.max_len} tokens"
            )
        with self._lock:
            self.waiting.append(request)

    def cancel(self, request: BatchRequest) -> None:
        with self._lock:
            self._cancelled.add(request.id)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- the scheduling thread ----------------------------------------------------------------------
    def step(self) -> bool:
        """One round (drop cancelled, admit, decode); returns False when there was nothing to do."""
        self._drop_cancelled()
        self._admit()
        if not self.running:
            return False
        self._decode()
        self.steps += 1
        return True

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                self.waiting = collections.deque(r for r in self.waiting if r.id not in cancelled)
        for request in [r for r in self.running if r.id in cancelled]:
            request.finish_reason = "cancelled"
            self.cancelled_count += 1
            self._leave(request)

    def _outstanding_blocks(self) -> int:
        """Blocks running requests may still claim before they finish (their budgets are guaranteed)."""
        size = self.cache.block_size
        return sum(
            -(-(len(r.prompt_ids) + r.settings.max_new_tokens) // size) - len(r.seq.blocks)
            for r in self.running
        )

    def _admit(self) -> None:
        while len(self.running) < self.max_batch:
            with self._lock:
                if not self.waiting:
                    return
                request = self.waiting[0]
                budget = -(
                    -(len(request.prompt_ids) + request.settings.max_new_tokens) // self.cache.block_size
                )
                if budget > self.cache.free_blocks - self._outstanding_blocks():
                    return  # wait for a running request to free its blocks
                self.waiting.popleft()
            self._prefill(request)

    def _prefill(self, request: BatchRequest) -> None:
        request.seq = self.cache.new_sequence()
        if request.settings.do_sample:
            request.generator = torch.Generator(device=self.decoder.device)
            request.generator.manual_seed(request.seed if request.seed is not None else request.id)
        ids = torch.tensor([request.prompt_ids], device=self.decoder.device)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        with torch.inference_mode():
            self.cache.begin_prefill(request.seq, ids.shape[1])
            logits = self.decoder.forward(ids, positions, self.cache)[:, -1]
            self.cache.end_step()
        self.running.append(request)
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        self._accept(request, next_tokens(logits, request.settings, request.generator)[0])

    def _decode(self) -> None:
        batch = list(self.running)
        device = self.decoder.device
        tokens = torch.tensor([[r.generated[-1]] for r in batch], device=device)
        positions = torch.tensor([[r.seq.length] for r in batch], device=device)
        with torch.inference_mode():
            self.cache.begin_decode([r.seq for r in batch])
            logits = self.decoder.forward(tokens, positions, self.cache)[:, -1]
            self.cache.end_step()
        greedy = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(batch):
            if request.settings.do_sample:
                token = next_tokens(logits[row : row + 1], request.settings, request.generator)[0]
            else:
                token = greedy[row]
            self._accept(request, token)

    def _accept(self, request: BatchRequest, token) -> None:
        token = int(token)
        request.generated.append(token)
        settings = request.settings
        if token in settings.eos_token_ids:
            request.finish_reason = "stop"
        elif len(request.generated) >= settings.max_new_tokens:
            request.finish_reason = "length"
        request.emit(token, request.finish_reason)
        if request.finish_reason is not None:
            self._leave(request)

    def _leave(self, request: BatchRequest) -> None:
        self.running.remove(request)
        self.cache.release(request.seq)
