"""The FastAPI application: OpenAI's completions and chat completions, MII's route, models, health, metrics.

Bodies are the typed models of protocol.py (refused with a 400 naming the field before a route runs); the
routes turn them into generations through ``GenerationService`` (service.py) and shape the answers
(responses.py). A non-streaming request whose client disconnects is cancelled; a streaming one is cancelled
when its stream is closed. A generation that fails answers 500 (or an error event in a stream) for that
request alone; one the server's shutdown ends (lifecycle.py) answers 503 the same way.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .chat import chat_prompt_ids
from .errors import APIError, error_body, install_error_handlers
from .guard import Guard
from .lifecycle import Lifecycle
from .metrics import CONTENT_TYPE
from .openapi import install_schema, responses
from .protocol import LIMIT, ChatCompletionRequest, CompletionRequest, MIIRequest
from .responses import chat_logprobs, completion_logprobs, sse
from .service import GenerationAborted, GenerationFailed, GenerationService, Run

__all__ = ["create_app"]

CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client


def _served_model():
    """A path parameter naming the served model (openapi.py); one object per route: FastAPI names it."""
    return Path(json_schema_extra={LIMIT: "model-name"})


class _ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(run: Run, request: Request) -> None:
    """Wait for every candidate, or cancel them all if the client goes away first."""
    work = asyncio.ensure_future(run.finish())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            run.cancel()
            work.cancel()
            raise _ClientGone
        work.result()
    finally:
        watcher.cancel()


def _best(run: Run, n: int) -> list:
    """Per prompt, its ``n`` candidates of best mean log-probability (best_of), in choice order."""
    by_prompt: dict[int, list] = {}
    for candidate in run.candidates:
        by_prompt.setdefault(candidate.prompt, []).append(candidate)
    chosen = []
    for group in by_prompt.values():
        if len(group) > n:
            group = sorted(group, key=lambda c: c.mean_logprob(), reverse=True)[:n]
        chosen += group
    return chosen


def create_app(service: GenerationService, *, metrics=None, api_key: str | None = None,
               max_body_bytes: int = 2**21, shutdown_timeout: float = 5.0) -> FastAPI:  # fmt: skip
    """The application over a started ``GenerationService``; ``app.state.lifecycle`` drains it (server.py)."""
    app = FastAPI(title="shardspeed-serve", version="1", summary="OpenAI-compatible completions and chat")
    lifecycle = app.state.lifecycle = Lifecycle(service, shutdown_timeout)
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, api_key=api_key, metrics=metrics,
                       routes=app.router.routes, lifecycle=lifecycle)  # fmt: skip
    install_error_handlers(app)
    _info_routes(app, service, metrics, lifecycle)
    _generation_routes(app, service)
    install_schema(app, vocab_size=service.vocab_size, context=service.context, model_name=service.model_name,
                   api_key=api_key is not None)  # fmt: skip
    return app


def _info_routes(app: FastAPI, service: GenerationService, metrics, lifecycle: Lifecycle) -> None:

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created,
                "owned_by": "shardspeed", "max_model_len": service.context}  # fmt: skip

    @app.get("/health", responses=responses("health"))
    async def health():
        loop, batcher = service.loop, service.loop.batcher
        stopping = loop.stopping or not lifecycle.serving
        status = "failed" if loop.error is not None else "stopping" if stopping else "ok"
        body = {"status": status, "running": len(batcher.running), "waiting": len(batcher.waiting),
                "cancelled_requests": batcher.cancelled_count, "failed_requests": batcher.failed_count,
                "max_batch_seen": batcher.max_running_seen, "free_kv_blocks": batcher.cache.free_blocks,
                "total_kv_blocks": batcher.cache.num_blocks}  # fmt: skip
        if loop.error is not None:
            body["error"] = repr(loop.error)
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    if metrics is not None:  # else no route: a 404 like any unknown path

        @app.get("/metrics", response_class=Response, responses=responses("metrics"))
        async def prometheus_metrics():
            return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}", responses=responses("model"))
    async def model(model: str = _served_model()):
        service.check_model(model)
        return model_card()


def _generation_routes(app: FastAPI, service: GenerationService) -> None:
    tokenizer = service.tokenizer

    @app.post("/v1/completions", responses=responses("stream"))
    async def completions(body: CompletionRequest, request: Request):
        service.check_model(body.model)
        prompts = service.encode(body.prompt)
        max_new = service.budget(prompts, body.max_tokens, "max_tokens", "prompt")
        generations = body.best_of or body.n
        # best_of ranks by mean log-probability: computed even when the client did not ask for them
        wanted = body.logprobs if body.logprobs is not None else (0 if generations > body.n else None)
        settings = service.settings(
            body, max_new, wanted, echo_logprobs=body.echo and body.logprobs is not None
        )
        run = service.start(prompts, settings, generations, body.seed, body.stops, body.stream)
        request.state.log.update(model=service.model_name, n=body.n, stream=body.stream, user=body.user)
        ids, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not isinstance(texts[0], str):  # token ids: the prompt's text is their decoding
            texts = [tokenizer.decode(p) for p in prompts]
        shape = _CompletionShape(tokenizer, body, prompts, texts)
        if body.stream:
            return StreamingResponse(
                _stream(service, run, request, shape, ids, created), media_type="text/event-stream"
            )
        await _finish(service, run, request)
        choices = [shape.choice(i, c, c.text.text) for i, c in enumerate(_best(run, body.n))]
        return {"id": ids, "object": "text_completion", "created": created, "model": service.model_name,
                "choices": choices, "usage": run.usage()}  # fmt: skip

    @app.post("/v1/chat/completions", responses=responses("stream"))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        service.check_model(body.model)
        prompts = [chat_prompt_ids(tokenizer, body.messages)]
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_new = service.budget(prompts, limit, name, "messages")
        wanted = (body.top_logprobs or 0) if body.logprobs else None
        settings = service.settings(body, max_new, wanted)
        run = service.start(prompts, settings, body.n, body.seed, body.stops, body.stream)
        request.state.log.update(model=service.model_name, n=body.n, stream=body.stream, user=body.user)
        ids, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        shape = _ChatShape(tokenizer, body)
        if body.stream:
            return StreamingResponse(
                _stream(service, run, request, shape, ids, created), media_type="text/event-stream"
            )
        await _finish(service, run, request)
        return {"id": ids, "object": "chat.completion", "created": created, "model": service.model_name,
                "choices": [shape.choice(c) for c in run.candidates], "usage": run.usage()}  # fmt: skip

    @app.post("/mii/{deployment_name}", responses=responses("generation"))
    async def mii_generate(body: MIIRequest, request: Request, deployment_name: str = _served_model()):
        if deployment_name != service.model_name:
            raise APIError(404, f"deployment_name: unknown deployment {deployment_name!r}", "deployment_name")
        prompts = service.encode(body.prompts, "prompts")
        if body.max_length is not None:  # MII's max_length counts the prompt too
            settings = [service.settings(body, service.budget([p], body.max_length - len(p), "max_length", "prompts"))
                        if body.max_length > len(p) else _too_short(body.max_length, len(p)) for p in prompts]  # fmt: skip
        else:
            settings = service.settings(
                body, service.budget(prompts, body.max_new_tokens or 128, "max_new_tokens", "prompts")
            )
        run = service.start(prompts, settings, 1, body.seed, body.stops)
        request.state.log.update(model=service.model_name, n=1, stream=False)
        await _finish(service, run, request)
        texts = [body.prompts] if isinstance(body.prompts, str) else body.prompts
        return [{"generated_text": (texts[c.prompt] if body.return_full_text else "") + c.text.text,
                 "prompt_length": len(c.request.prompt_ids), "generated_length": len(c.tokens),
                 "finish_reason": c.finish_reason} for c in run.candidates]  # fmt: skip


def _too_short(max_length: int, prompt_length: int):
    raise APIError(400, f"max_length: {max_length} leaves no new token after a prompt of {prompt_length} tokens "
                   "(MII's max_length counts the prompt)", "max_length", "context_length_exceeded")  # fmt: skip


def _failure(error: GenerationFailed) -> str:
    if isinstance(error, GenerationAborted):
        return f"{error}: the generation was ended before it finished"
    return f"generation failed: {error}"


async def _finish(service: GenerationService, run: Run, request: Request) -> None:
    try:
        await _collect(run, request)
    except GenerationFailed as error:
        raise APIError(error.status, _failure(error)) from None
    except _ClientGone:
        raise APIError(CLIENT_GONE, "the client went away; its request was cancelled") from None
    finally:
        service.finished(run)
        request.state.log.update(run.log())


class _CompletionShape:
    """Completions' choice and chunk shapes for one request."""

    object = "text_completion"

    def __init__(self, tokenizer, body: CompletionRequest, prompts, texts):
        self.tokenizer, self.body, self.prompts, self.texts = tokenizer, body, prompts, texts

    def _logprobs(self, candidate, choices, with_prompt: bool):
        if self.body.logprobs is None:
            return None
        prompt_text = self.texts[candidate.prompt]
        if with_prompt and self.body.echo:
            first = self.prompts[candidate.prompt][0]
            return completion_logprobs(self.tokenizer, choices, 0, candidate.request.prompt_choices, first)
        return completion_logprobs(self.tokenizer, choices, len(prompt_text))

    def choice(self, index: int, candidate, text: str) -> dict:
        prefix = self.texts[candidate.prompt] if self.body.echo else ""
        choices = candidate.request.token_logprobs[: len(candidate.tokens)]
        return {"index": index, "text": prefix + text, "finish_reason": candidate.finish_reason,
                "logprobs": self._logprobs(candidate, choices, True)}  # fmt: skip

    def opening(self, candidate) -> dict | None:
        if not self.body.echo:
            return None
        return {"index": candidate.index, "text": self.texts[candidate.prompt], "finish_reason": None,
                "logprobs": None if self.body.logprobs is None else completion_logprobs(
                    self.tokenizer, [], 0, candidate.request.prompt_choices, self.prompts[candidate.prompt][0])}  # fmt: skip

    def delta(self, candidate, text: str) -> dict:
        logprobs = self._logprobs(candidate, candidate.new_logprobs(), False)
        return {
            "index": candidate.index,
            "text": text,
            "finish_reason": candidate.finish_reason,
            "logprobs": logprobs,
        }


class _ChatShape:
    object = "chat.completion.chunk"

    def __init__(self, tokenizer, body: ChatCompletionRequest):
        self.tokenizer, self.body = tokenizer, body

    def choice(self, candidate) -> dict:
        logprobs = None
        if self.body.logprobs:
            logprobs = chat_logprobs(
                self.tokenizer, candidate.request.token_logprobs[: len(candidate.tokens)]
            )
        return {"index": candidate.index, "message": {"role": "assistant", "content": candidate.text.text},
                "logprobs": logprobs, "finish_reason": candidate.finish_reason}  # fmt: skip

    def opening(self, candidate) -> dict:
        return {"index": candidate.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip

    def delta(self, candidate, text: str) -> dict:
        logprobs = chat_logprobs(self.tokenizer, candidate.new_logprobs()) if self.body.logprobs else None
        delta = {"content": text} if text else {}
        return {
            "index": candidate.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": candidate.finish_reason,
        }


async def _stream(service: GenerationService, run: Run, request: Request, shape, ids: str, created: int):
    """Server-sent events: OpenAI's chunks, then a usage chunk if asked, then ``[DONE]``; a generation that
    fails or is ended by the server's shutdown: an error event (OpenAI's error body), then ``[DONE]``."""
    options = shape.body.stream_options
    usage = options is not None and options.include_usage
    object_name = "text_completion" if isinstance(shape, _CompletionShape) else "chat.completion.chunk"

    def chunk(choices: list[dict], **extra) -> str:
        payload = {"id": ids, "object": object_name, "created": created, "model": service.model_name,
                   "choices": choices, **extra}  # fmt: skip
        if usage and "usage" not in extra:
            payload["usage"] = None
        return sse(payload)

    try:
        for candidate in run.candidates:
            opening = shape.opening(candidate)
            if opening is not None:
                yield chunk([opening])
        # With log-probabilities asked for, every token gets its chunk (its text may be held back: empty).
        every_token = shape.body.logprobs not in (None, False)
        async for candidate, text in run.events():
            if text or every_token or candidate.finish_reason is not None:
                yield chunk([shape.delta(candidate, text)])
        if usage:
            yield chunk([], usage=run.usage())
        yield sse("[DONE]")
    except GenerationFailed as error:  # OpenAI's error event, then the end of the stream as always
        yield sse(error_body(error.status, _failure(error)))
        yield sse("[DONE]")
    finally:
        run.cancel()  # a no-op for finished candidates; the rest (client gone) leave the batch
        service.finished(run)
        request.state.log.update(run.log())
