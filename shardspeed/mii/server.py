"""The HTTP server (FastAPI + uvicorn, the ``serve`` extra) and the ``shardspeed-serve`` command.

Routes: ``POST /v1/completions`` (OpenAI's completions API, ``"stream": true`` as server-sent events),
``POST /mii/{deployment_name}`` (MII's REST route: ``{"prompts": [...], "max_length": n}``),
``GET /v1/models``, ``GET /health``. A bad request gets a 4xx JSON body
``{"error": {"message", "type", "param"}}`` naming the field; the server keeps serving. A client that goes
away mid-stream has its request cancelled: it leaves the batch and its KV blocks go back at the next round.

With ``--tensor-parallel N`` the command restarts itself through shardspeed's launcher on N local ranks;
rank 0 serves HTTP and drives the generation loop, the others follow it (engine_loop.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("the inference server needs its web stack: pip install 'shardspeed[serve]'") from error

from shardspeed.inference.scheduler import BatchRequest, ContinuousBatcher

from .engine_loop import EngineLoop
from .pipeline import load_model, settings_for

__all__ = ["RequestError", "create_app", "main"]


class RequestError(Exception):
    """A client error: HTTP ``status``, the offending field ``param``, a message naming it."""

    def __init__(self, status: int, param: str | None, message: str):
        super().__init__(message)
        self.status, self.param, self.message = status, param, message


def _int_field(body: dict, name: str, default, low: int):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(400, name, f"{name}: must be an integer >= {low}, got {json.dumps(value)}")
    return value


def _float_field(body: dict, name: str, default: float, low: float, high: float | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value < low
        or (high and value > high)
    ):
        bounds = f">= {low}" + (f" and <= {high}" if high else "")
        raise RequestError(400, name, f"{name}: must be a number {bounds}, got {json.dumps(value)}")
    return float(value)


def _prompts(body: dict, name: str) -> list[str]:
    if name not in body:
        raise RequestError(400, name, f"{name}: required field missing")
    value = body[name]
    prompts = [value] if isinstance(value, str) else value
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise RequestError(400, name, f"{name}: must be a non-empty string or a list of non-empty strings")
    return prompts


class CompletionService:
    """What the routes share: the tokenizer, the loop, the limits; turns requests into generations."""

    def __init__(self, engine, tokenizer, loop: EngineLoop, model_name: str):
        self.engine, self.tokenizer, self.loop, self.model_name = engine, tokenizer, loop, model_name
        self.context = engine.config.max_out_tokens

    def parse(self, body: dict, prompt_key: str, max_key: str, default_max: int):
        prompts = _prompts(body, prompt_key)
        max_new = _int_field(body, max_key, default_max, 1)
        temperature = _float_field(body, "temperature", 0.0, 0.0)
        top_p = _float_field(body, "top_p", 1.0, 0.0, 1.0)
        seed = _int_field(body, "seed", None, 0)
        sampling = dict(do_sample=temperature > 0, temperature=temperature or None, top_p=top_p)
        settings = settings_for(self.engine, self.tokenizer, max_new, **sampling)
        encoded = [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        for ids in encoded:
            if len(ids) + max_new > self.context:
                raise RequestError(
                    400, max_key, f"{max_key}: prompt ({len(ids)} tokens) + {max_key} ({max_new}) exceeds the "
                    f"model's context of {self.context} tokens",
                )  # fmt: skip
        return encoded, settings, seed

    def start(self, encoded, settings, seed) -> list[tuple[BatchRequest, asyncio.Queue]]:
        loop = asyncio.get_running_loop()
        started = []
        for ids in encoded:
            queue: asyncio.Queue = asyncio.Queue()

            def emit(token, reason, queue=queue):
                loop.call_soon_threadsafe(queue.put_nowait, (token, reason))

            request = BatchRequest(prompt_ids=ids, settings=settings, emit=emit, seed=seed)
            self.loop.submit(request)
            started.append((request, queue))
        return started

    async def finish(self, started) -> list[dict]:
        results = []
        try:
            for request, queue in started:
                reason = None
                while reason is None:
                    _, reason = await queue.get()
                if reason.startswith("error"):
                    raise RequestError(400, None, reason)
                text = self.tokenizer.decode(request.generated, skip_special_tokens=True)
                results.append(dict(text=text, reason=reason, prompt=len(request.prompt_ids),
                                    generated=len(request.generated)))  # fmt: skip
        finally:
            for request, _ in started:
                if request.finish_reason is None:
                    self.loop.cancel(request)
        return results


def _error(status: int, param, message: str):
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param}}, status_code=status)


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(400, "body", f"body: malformed JSON ({error})") from None
    if not isinstance(body, dict):
        raise RequestError(400, "body", "body: must be a JSON object")
    return body


def _usage(results) -> dict:
    prompt = sum(r["prompt"] for r in results)
    completion = sum(r["generated"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(service: CompletionService):
    """The FastAPI application over a running ``CompletionService``."""
    app = FastAPI(title="shardspeed-serve")

    @app.exception_handler(RequestError)
    async def request_error(_request, error: RequestError):
        return _error(error.status, error.param, error.message)

    @app.get("/health")
    async def health():
        batcher = service.loop.batcher
        return {"status": "ok" if service.loop.error is None else "failed", "running": len(batcher.running),
                "waiting": len(batcher.waiting), "cancelled_requests": batcher.cancelled_count,
                "max_batch_seen": batcher.max_running_seen,
                "free_kv_blocks": batcher.cache.free_blocks, "total_kv_blocks": batcher.cache.num_blocks}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": service.model_name, "object": "model", "owned_by": "shardspeed"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        model = body.get("model", service.model_name)
        if model != service.model_name:
            raise RequestError(404, "model", f"model: unknown model {json.dumps(model)}; this server serves "
                               f"{json.dumps(service.model_name)}")  # fmt: skip
        if _int_field(body, "n", 1, 1) != 1:
            raise RequestError(400, "n", "n: only n = 1 is supported")
        encoded, settings, seed = service.parse(body, "prompt", "max_tokens", 16)
        started = service.start(encoded, settings, seed)
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):
            return StreamingResponse(_stream(service, started, completion_id, created),
                                     media_type="text/event-stream")  # fmt: skip
        results = await service.finish(started)
        choices = [{"index": i, "text": r["text"], "finish_reason": r["reason"], "logprobs": None}
                   for i, r in enumerate(results)]  # fmt: skip
        return {"id": completion_id, "object": "text_completion", "created": created, "model": service.model_name,
                "choices": choices, "usage": _usage(results)}  # fmt: skip

    @app.post("/mii/{deployment_name}")
    async def mii_generate(deployment_name: str, request: Request):
        if deployment_name != service.model_name:
            raise RequestError(
                404, "deployment_name", f"deployment_name: unknown deployment {deployment_name!r}"
            )
        body = await _json_body(request)
        key = "max_new_tokens" if "max_new_tokens" in body else "max_length"
        encoded, settings, seed = service.parse(body, "prompts", key, 128)
        results = await service.finish(service.start(encoded, settings, seed))
        return [{"generated_text": r["text"], "prompt_length": r["prompt"], "generated_length": r["generated"],
                 "finish_reason": r["reason"]} for r in results]  # fmt: skip

    return app


async def _stream(service: CompletionService, started, completion_id: str, created: int):
    """Server-sent events, one per new piece of text; cancelling the generator cancels the requests."""
    try:
        for index, (_, queue) in enumerate(started):
            tokens, sent, reason = [], "", None
            while reason is None:
                token, reason = await queue.get()
                if reason is not None and reason.startswith("error"):
                    error = {"error": {"message": reason[len("error: ") :], "type": "invalid_request_error"}}
                    yield f"data: {json.dumps(error)}\n\n"
                    return
                tokens.append(token)
                # Decode everything so far: a character may span several byte tokens.
                text = service.tokenizer.decode(tokens, skip_special_tokens=True)
                delta, sent = text[len(sent) :], text
                if not delta and reason is None:
                    continue
                chunk = {"id": completion_id, "object": "text_completion", "created": created,
                         "model": service.model_name,
                         "choices": [{"index": index, "text": delta, "finish_reason": reason, "logprobs": None}]}  # fmt: skip
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for request, _ in started:
            if request.finish_reason is None:
                service.loop.cancel(request)


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        "shardspeed-serve", description="Serve a Hugging Face causal LM over HTTP"
    )
    parser.add_argument("model_dir", help="directory with config.json, *.safetensors and the tokenizer")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=28080)
    parser.add_argument(
        "--deployment-name", default=None, help="model name in requests (default: directory name)"
    )
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks each layer is split over")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--max-batch", type=int, default=32, help="requests decoded together at most")
    parser.add_argument("--max-tokens", type=int, default=None, help="context limit (default: the model's)")
    return parser.parse_args(argv)


def _relaunch_under_launcher(args, argv) -> int:
    """Become shardspeed's launcher running this command on ``--tensor-parallel`` local ranks.

    ``exec`` rather than a child process: a signal sent to this command (Ctrl-C, ``kill``) then reaches the
    launcher, which stops every rank; rank 0's server shuts down and tells the other ranks to stop.
    """
    command = [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", str(args.tensor_parallel),
               "--master_port", str(args.port + 1), "--no_local_rank", "--module", "shardspeed.mii.server", *argv]  # fmt: skip
    os.execv(sys.executable, command)
    return 1  # not reached


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    if args.tensor_parallel > 1 and "RANK" not in os.environ:
        return _relaunch_under_launcher(args, argv)
    import torch

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    engine, tokenizer = load_model(args.model_dir, tensor_parallel=args.tensor_parallel, dtype=dtype,
                                   max_out_tokens=args.max_tokens)  # fmt: skip
    batcher = ContinuousBatcher(
        engine.decoder, max_len=engine.config.max_out_tokens, max_batch=args.max_batch
    )
    loop = EngineLoop(batcher, engine.mp_group)
    if engine.tp_rank != 0:
        loop.follow()
        return 0
    import uvicorn

    name = args.deployment_name or os.path.basename(os.path.normpath(args.model_dir))
    app = create_app(CompletionService(engine, tokenizer, loop, name))
    loop.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        loop.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
