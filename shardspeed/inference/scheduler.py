"""Continuous batching: many requests of different lengths decoded together over a paged KV cache.

``ContinuousBatcher.step()`` is one scheduling round:
  1. requests cancelled since the last round (a client went away) leave and free their blocks;
  2. waiting requests join while there is a batch slot and KV blocks for their whole budget (prompt +
     ``max_new_tokens``, so a running request can never run out of blocks half-way): each is prefilled on
     its own (its prompt attends only to itself) and emits its first token. With prefix caching, the
     full blocks its prompt shares with an earlier prompt are taken from the cache, not computed;
  3. one decode step over every running request, whatever its length (the paged cache masks each row to
     its own length); a request that hits a stop token or its budget leaves at once.
New requests therefore join between decode steps and finished ones never wait for the rest of a batch.
Tokens go out through each request's ``emit(token, finish_reason)`` callback (finish_reason None while
running, "stop" or "length" on the last call, "error" with ``request.error`` set, "cancelled" never
emitted). The batcher is not thread-safe by itself: ``submit`` and ``cancel`` only append to queues; one
thread calls ``step``.

A failure while prefilling or sampling one request ends that request ("error") and the round goes on. A
failing batched decode step is retried one request at a time, so only the requests that fail alone end.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .generation import GenerationSettings
from .kv_cache import PagedKVCache, PagedSequence
from .sampling import Choice, choose, prompt_logprobs

__all__ = ["BatchRequest", "ContinuousBatcher"]

_ids = itertools.count()
logger = logging.getLogger(__name__)


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
    error: str | None = None  # why the request failed (finish_reason "error")
    token_logprobs: list[Choice] = field(default_factory=list)  # one per generated token, when asked
    prompt_choices: list[Choice] = field(default_factory=list)  # prompt tokens 1.., when asked (echo)
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache


class ContinuousBatcher:
    """Schedules ``BatchRequest``s over a ``FastDecoder`` and a ``PagedKVCache`` (see module docstring)."""

    def __init__(self, decoder, *, max_len: int, max_batch: int = 32, block_size: int = 16, num_blocks=None,
                 prefix_caching: bool = False):  # fmt: skip
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
            dtype=decoder.dtype, device=decoder.device, prefix_caching=prefix_caching, **decoder.cache_spec(),
        )  # fmt: skip
        self.waiting: collections.deque[BatchRequest] = collections.deque()
        self.running: list[BatchRequest] = []
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.steps = 0
        self.max_running_seen = 0
        self.cancelled_count = 0
        self.failed_count = 0
        self.prompt_tokens_computed = 0  # prefilled tokens (cached prefixes not counted)

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
        size = self.cache.block_size
        while len(self.running) < self.max_batch:
            with self._lock:
                if not self.waiting:
                    return
                request = self.waiting[0]
                keys = self.cache.prompt_keys(request.prompt_ids)
                shared, evictable = [], 0
                if not request.settings.prompt_logprobs:  # those need every prompt position's logits
                    shared, evictable = self.cache.reusable(request.prompt_ids, keys)
                budget = -(-(len(request.prompt_ids) + request.settings.max_new_tokens) // size) - len(shared)
                if budget > self.cache.free_blocks - evictable - self._outstanding_blocks():
                    return  # wait for a running request to free its blocks
                self.waiting.popleft()
            self._prefill(request, shared, keys)

    def _prefill(self, request: BatchRequest, shared: list[int], keys: list[bytes]) -> None:
        request.seq = self.cache.new_sequence()
        settings = request.settings
        try:
            if settings.do_sample:
                request.generator = torch.Generator(device=self.decoder.device)
                request.generator.manual_seed(request.seed if request.seed is not None else request.id)
            self.cache.share_prefix(request.seq, shared)
            start = request.cached_tokens = request.seq.cached_tokens
            device = self.decoder.device
            ids = torch.tensor([request.prompt_ids[start:]], device=device)
            positions = torch.arange(start, len(request.prompt_ids), device=device)[None]
            with torch.inference_mode():
                self.cache.begin_prefill(request.seq, ids.shape[1])
                logits = self.decoder.forward(
                    ids, positions, self.cache, last_only=not settings.prompt_logprobs
                )
                self.cache.end_step()
            self.prompt_tokens_computed += ids.shape[1]
            self.cache.register_prompt(request.seq, keys)
            if settings.prompt_logprobs:
                request.prompt_choices = prompt_logprobs(
                    logits[0], request.prompt_ids, settings.logprobs or 0
                )
            choice = self._choose(request, logits[0, -1])
        except Exception as error:  # this request only: the others go on
            self.cache.abort_step()
            self._fail(request, error, "prefill")
            return
        self.running.append(request)
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        self._accept(request, choice)

    def _forward_decode(self, batch: list[BatchRequest]) -> torch.Tensor:
        device = self.decoder.device
        tokens = torch.tensor([[r.generated[-1]] for r in batch], device=device)
        positions = torch.tensor([[r.seq.length] for r in batch], device=device)
        with torch.inference_mode():
            self.cache.begin_decode([r.seq for r in batch])
            logits = self.decoder.forward(tokens, positions, self.cache)[:, -1]
            self.cache.end_step()
        return logits

    def _decode(self) -> None:
        batch = list(self.running)
        try:
            logits = self._forward_decode(batch)
        except Exception as error:
            self.cache.abort_step()
            logger.warning(
                "batched decode failed (%r); retrying each of %d requests alone", error, len(batch)
            )
            batch, logits = self._decode_alone(batch)
        if not batch:
            return
        # One host sync for every greedy row of the batch; the others choose one row at a time.
        greedy = logits.argmax(dim=-1).tolist() if any(r.settings.plain for r in batch) else None
        for row, request in enumerate(batch):
            try:
                choice = Choice(greedy[row]) if request.settings.plain else self._choose(request, logits[row])
            except Exception as error:
                self._fail(request, error, "sampling")
                continue
            self._accept(request, choice)

    def _decode_alone(self, batch: list[BatchRequest]):
        survivors, rows = [], []
        for request in batch:
            try:
                rows.append(self._forward_decode([request])[0])
                survivors.append(request)
            except Exception as error:
                self.cache.abort_step()
                self._fail(request, error, "decode")
        return survivors, (torch.stack(rows) if rows else None)

    def _choose(self, request: BatchRequest, logits: torch.Tensor) -> Choice:
        return choose(logits, request.settings, request.prompt_ids, request.generated, request.generator)

    def _accept(self, request: BatchRequest, choice: Choice) -> None:
        token = choice.token
        request.generated.append(token)
        settings = request.settings
        if settings.logprobs is not None:
            request.token_logprobs.append(choice)
        if token in settings.eos_token_ids and not settings.ignore_eos:
            request.finish_reason = "stop"
        elif len(request.generated) >= settings.max_new_tokens:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            self._leave(request)
        self._emit(request, token)

    def _emit(self, request: BatchRequest, token: int) -> None:
        try:
            request.emit(token, request.finish_reason)
        except Exception:  # a broken listener must not stop the batch: drop its request
            logger.exception("request %d: its emit callback failed; cancelling it", request.id)
            if request.finish_reason is None:
                self.cancel(request)

    def _fail(self, request: BatchRequest, error: BaseException, stage: str) -> None:
        logger.error("request %d failed during %s: %r", request.id, stage, error, exc_info=error)
        request.finish_reason = "error"
        request.error = f"{stage} failed: {type(error).__name__}: {error}"
        self.failed_count += 1
        self._leave(request)
        self._emit(request, -1)

    def _leave(self, request: BatchRequest) -> None:
        if request in self.running:
            self.running.remove(request)
        if request.seq is not None:
            self.cache.release(request.seq)

    def abort_all(self, message: str) -> None:
        """End every waiting and running request with ``message`` (shutdown, or a loop that cannot go on)."""
        with self._lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for request in waiting + list(self.running):
            request.finish_reason, request.error = "error", message
            self._leave(request)
            self._emit(request, -1)
