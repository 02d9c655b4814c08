"""Between HTTP and the batcher: validated requests become generations, generated tokens become text.

``GenerationService.settings`` turns a request's sampling fields into ``GenerationSettings`` (checking what
depends on the model: context length, vocabulary); ``start`` submits one ``BatchRequest`` per prompt and
choice to the generation loop and returns a ``Run``. ``Run.events()`` yields ``(candidate, new_text)`` as
tokens arrive, with stop strings applied (a candidate that meets one is cancelled in the batcher and ends
with finish_reason "stop"); ``Run.cancel()`` drops whatever is unfinished (a client that went away).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shardspeed.inference.generation import GenerationSettings
from shardspeed.inference.sampling import GREEDY_BELOW
from shardspeed.inference.scheduler import BatchRequest

from .errors import APIError
from .text import TextStream

__all__ = ["Candidate", "GenerationAborted", "GenerationFailed", "GenerationService", "Run"]

MAX_CANDIDATES = 256  # prompts x n (or best_of) in one request
CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt and budget over the context


class GenerationFailed(Exception):
    """The generation of one request failed in the batcher (a 500 for that request only)."""

    status = 500


class GenerationAborted(GenerationFailed):
    """The server ended a generation before it finished (shutting down): a 503."""

    status = 503


_ABORT = object()  # put in a run's queue by Run.abort: its events end there


@dataclass(eq=False)
class Candidate:
    """One generation of a request: prompt ``prompt`` (an index), choice ``index`` of the response."""

    index: int
    prompt: int
    request: BatchRequest
    text: TextStream
    finish_reason: str | None = None
    reported: int = 0  # tokens whose log-probabilities went out already (streaming)
    last_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens

    def new_logprobs(self) -> list:
        """Log-probabilities of the tokens since the last call."""
        upto = len(self.text.tokens)
        fresh, self.reported = self.request.token_logprobs[self.reported : upto], upto
        return fresh

    def mean_logprob(self) -> float:
        chosen = [c.logprob for c in self.request.token_logprobs[: len(self.tokens)]]
        return sum(chosen) / max(1, len(chosen))


@dataclass(eq=False)
class Run:
    service: GenerationService
    candidates: list[Candidate]
    queue: asyncio.Queue
    started_at: float = field(default_factory=time.perf_counter)
    first_token_ms: float | None = None
    closed: bool = False  # answered (service.finished): tokens still on their way are dropped
    aborted: str | None = None  # why the server ended it (Run.abort)

    async def events(self):
        """``(candidate, new_text)`` per token, until every candidate has finished (or ``abort``)."""
        pending = len(self.candidates)
        while pending:
            item = await self.queue.get()
            if item is _ABORT:
                raise GenerationAborted(self.aborted)
            index, token, reason = item
            candidate = self.candidates[index]
            if candidate.finish_reason is not None:
                continue  # tokens decoded after a stop string, before the cancellation took effect
            if reason == "error":
                self.cancel()
                raise GenerationFailed(candidate.request.error or "generation failed")
            self._timing(candidate)
            delta = candidate.text.add(token)
            if candidate.text.stopped:
                candidate.finish_reason = "stop"
                self.service.loop.cancel(candidate.request)
            elif reason is not None:
                candidate.finish_reason = reason
                delta += candidate.text.finish()
            pending -= candidate.finish_reason is not None
            yield candidate, delta

    def _timing(self, candidate: Candidate) -> None:
        now, metrics = time.perf_counter(), self.service.metrics
        if candidate.last_token_at is None:
            if self.first_token_ms is None:
                self.first_token_ms = round(1000 * (now - self.started_at), 1)
            if metrics is not None:
                metrics.time_to_first_token.observe(now - self.started_at)
        elif metrics is not None:
            metrics.inter_token_latency.observe(now - candidate.last_token_at)
        candidate.last_token_at = now

    async def finish(self) -> None:
        async for _ in self.events():
            pass

    def abort(self, message: str) -> None:
        """End the run from the server's side (on the event loop's thread): its candidates leave the batch
        and ``events`` raises ``GenerationAborted(message)`` after the tokens already queued."""
        self.aborted = message
        self.cancel()
        self.queue.put_nowait(_ABORT)

    def cancel(self) -> None:
        for candidate in self.candidates:
            if candidate.finish_reason is None and candidate.request.finish_reason is None:
                self.service.loop.cancel(candidate.request)
            candidate.finish_reason = candidate.finish_reason or "cancelled"

    def usage(self) -> dict:
        """OpenAI's usage: each prompt counted once (not once per choice), every generated token."""
        first: dict[int, Candidate] = {}
        for candidate in self.candidates:
            first.setdefault(candidate.prompt, candidate)
        prompt = sum(len(c.request.prompt_ids) for c in first.values())
        completion = sum(len(c.tokens) for c in self.candidates)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens()}}  # fmt: skip

    def cached_tokens(self) -> int:
        """Prompt tokens that came from the prefix cache, counted once per prompt as prompt tokens are."""
        first: dict[int, int] = {}
        for candidate in self.candidates:
            first.setdefault(candidate.prompt, candidate.request.cached_tokens)
        return sum(first.values())

    def log(self) -> dict:
        """What the request's log line says about the generation."""
        return {"completion_tokens": sum(len(c.tokens) for c in self.candidates),
                "cached_tokens": self.cached_tokens(), "ttft_ms": self.first_token_ms,
                "finish_reasons": sorted({c.finish_reason or "unfinished" for c in self.candidates})}  # fmt: skip


class GenerationService:
    """What the routes share: model, tokenizer, generation loop, limits, metrics."""

    def __init__(self, engine, tokenizer, loop, model_name: str, metrics=None):
        self.engine, self.tokenizer, self.loop, self.model_name = engine, tokenizer, loop, model_name
        self.metrics = metrics
        self.accepting = True  # False once the server drains (lifecycle.py): new generations get 503
        self.runs: set[Run] = set()  # started and not yet answered
        self.context = engine.config.max_out_tokens
        config = getattr(engine.module, "config", None)
        self.vocab_size = getattr(config, "vocab_size", None) or len(tokenizer)
        self.eos_token_ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        self.created = int(time.time())

    # ---- checks that depend on the model ----------------------------------------------------------
    def check_model(self, model: str | None, param: str = "model") -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"{param}: unknown model {model!r}; this server serves {self.model_name!r}",
                           param, "model_not_found")  # fmt: skip

    def encode(self, prompt, param: str = "prompt") -> list[list[int]]:
        """A completion prompt (string, strings, token ids, lists of token ids) as lists of token ids."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            encoded = [list(self.tokenizer(text)["input_ids"]) for text in texts]
        else:
            encoded = [prompt] if isinstance(prompt[0], int) else prompt
        for ids in encoded:
            if not ids:
                raise APIError(400, f"{param}: encodes to no tokens", param, "empty_prompt")
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"{param}: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                    param,
                )
        return encoded

    def budget(self, prompts: list[list[int]], max_new: int | None, param: str, prompt_param: str) -> int:
        """New tokens per generation: ``max_new`` checked against the context, or all the context left."""
        longest = max(len(p) for p in prompts)
        if longest >= self.context:
            raise APIError(400, f"{prompt_param}: {longest} tokens leave no room in the model's context of "
                           f"{self.context} tokens", prompt_param, CONTEXT_EXCEEDED)  # fmt: skip
        if max_new is None:
            return self.context - longest
        if longest + max_new > self.context:
            raise APIError(400, f"{param}: prompt ({longest} tokens) + {param} ({max_new}) exceeds the model's "
                           f"context of {self.context} tokens", param, CONTEXT_EXCEEDED)  # fmt: skip
        return max_new

    def settings(self, body, max_new: int, logprobs: int | None = None, echo_logprobs: bool = False):
        """``GenerationSettings`` from a request's sampling fields (protocol._Sampling or MIIRequest)."""
        temperature = 1.0 if body.temperature is None else body.temperature
        do_sample = temperature >= GREEDY_BELOW and getattr(body, "do_sample", True)
        bias = {int(token): value for token, value in (getattr(body, "logit_bias", None) or {}).items()}
        outside = [t for t in bias if t >= self.vocab_size]
        if outside:
            raise APIError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary "
                           f"(0..{self.vocab_size - 1})", "logit_bias")  # fmt: skip
        min_new = getattr(body, "min_tokens", None) or getattr(body, "min_new_tokens", 0)
        if min_new > max_new:
            name = "min_tokens" if hasattr(body, "min_tokens") else "min_new_tokens"
            raise APIError(400, f"{name}: {min_new} is more than the {max_new} new tokens allowed", name,
                           "min_tokens_above_max_tokens")  # fmt: skip
        settings = GenerationSettings(
            max_new_tokens=max_new, do_sample=do_sample, temperature=temperature if do_sample else 1.0,
            top_k=max(0, body.top_k or 0), top_p=1.0 if body.top_p is None else body.top_p,
            eos_token_ids=list(self.eos_token_ids), pad_token_id=None,
            presence_penalty=getattr(body, "presence_penalty", 0.0),
            frequency_penalty=getattr(body, "frequency_penalty", 0.0),
            repetition_penalty=getattr(body, "repetition_penalty", None) or 1.0,
            logit_bias=bias, min_new_tokens=min_new, ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=echo_logprobs,
        )  # fmt: skip
        settings.check()
        return settings

    # ---- running ----------------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], settings, n: int, seed, stops, stream: bool = False) -> Run:
        """One generation per prompt and choice; ``settings`` one for all prompts or a list, one each."""
        if len(prompts) * n > MAX_CANDIDATES:
            raise APIError(
                400,
                f"n: {len(prompts)} prompts x {n} generations exceeds {MAX_CANDIDATES} per request",
                "n",
                "too_many_generations",
            )
        if self.loop.error is not None:
            raise APIError(503, f"the generation loop failed ({self.loop.error!r}); the server is stopping")
        if self.loop.stopping or not self.accepting:
            raise APIError(503, "the server is shutting down")
        event_loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        candidates = []
        run: Run | None = None
        for prompt_index, ids in enumerate(prompts):
            for choice in range(n):
                index = len(candidates)

                def emit(token, reason, index=index):  # called on the generation thread
                    if run is None or run.closed:
                        return  # answered already: nobody listens
                    try:
                        event_loop.call_soon_threadsafe(queue.put_nowait, (index, token, reason))
                    except RuntimeError:  # "Event loop is closed": the server has gone, nobody listens
                        if not event_loop.is_closed():
                            raise

                # Each choice its own seed (a given seed stays reproducible); none given: the request id.
                choice_seed = None if seed is None else (seed + choice) % 2**63
                own = settings[prompt_index] if isinstance(settings, list) else settings
                request = BatchRequest(prompt_ids=ids, settings=own, emit=emit, seed=choice_seed)
                text = TextStream(self.tokenizer, stops, incremental=stream)
                candidates.append(Candidate(index, prompt_index, request, text))
        run = Run(self, candidates, queue)
        self.runs.add(run)
        for candidate in candidates:
            self.loop.submit(candidate.request)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return run

    def finished(self, run: Run) -> None:
        """A run answered: forget it, count its tokens in the metrics."""
        run.closed = True
        self.runs.discard(run)
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(sum(len(c.tokens) for c in run.candidates))
            self.metrics.cached_prompt_tokens.inc(run.cached_tokens())

    def abort_all(self, message: str) -> int:
        """End every run not yet answered (``Run.abort``); how many there were."""
        runs = [run for run in self.runs if not run.closed]
        for run in runs:
            run.abort(message)
        return len(runs)
