"""What every HTTP request passes through before a route sees it, and the log line it leaves behind.

``Guard`` is a plain ASGI middleware (it sees streamed responses as they go):
  * body size: a body over ``max_body_bytes`` is refused with 413 before it is read (by its Content-Length)
    or as soon as it grows past the limit (chunked); the body is then handed on to the route as read;
  * API key: with ``api_key`` set, routes under ``/v1`` and ``/mii`` need ``Authorization: Bearer <key>``
    (401 otherwise); ``/health``, ``/metrics`` and the schema stay open for probes and scrapers;
  * shutdown (lifecycle.py): each request in flight is counted (probes, scrapes and the schema are not);
    while the server drains, a new POST gets 503 at once, and once it closes, a request still sending its
    body gets 503 instead of waiting for the rest;
  * one structured log line (JSON, logger ``shardspeed.mii.access``) per request: method, path, status,
    duration, and what the route left in ``request.state.log`` (token counts, finish reasons, ...); the
    request counter by status in ``/metrics`` is counted here as well.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from starlette.routing import Match

from .errors import error_body

__all__ = ["Guard"]

access_log = logging.getLogger("shardspeed.mii.access")

_OPEN = ("/health", "/metrics", "/openapi.json", "/docs", "/redoc")
_CLOSE = [(b"connection", b"close")]  # a request refused while the server stops: no keep-alive after it


async def _send_error(send, status: int, message: str, param=None, code=None, headers=()) -> None:
    body = json.dumps(error_body(status, message, param, code)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, *, max_body_bytes: int, api_key: str | None = None, metrics=None, routes=(),
                 lifecycle=None):  # fmt: skip
        self.app, self.max_body_bytes, self.api_key, self.metrics = app, max_body_bytes, api_key, metrics
        self.routes = routes  # the application's routes, to name the route of a request answered here
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        state["log"] = {}
        outcome = {"status": 500}

        async def send_watched(message):
            if message["type"] == "http.response.start":
                outcome["status"] = message["status"]
            await send(message)

        counted = self.lifecycle is not None and not scope["path"].startswith(_OPEN)
        if counted:
            self.lifecycle.in_flight += 1
        try:
            if counted and not self.lifecycle.serving and scope["method"] == "POST":
                await _send_error(send_watched, 503, "the server is shutting down", headers=_CLOSE)
            else:
                await self._guarded(scope, receive, send_watched)
        finally:
            if counted:
                self.lifecycle.in_flight -= 1
            self._record(scope, outcome["status"], time.perf_counter() - start, state["log"])

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and not scope["path"].startswith(_OPEN):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _send_error(
                    send, 401, "authorization: a valid API key is needed (Authorization: Bearer <key>)",
                    "authorization", "invalid_api_key", [(b"www-authenticate", b"Bearer")],
                )  # fmt: skip
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(send)
        body, size = [], 0
        while True:
            message = await self._receive_unless_closing(receive)
            if message is None:
                return await _send_error(send, 503, "the server is shutting down", headers=_CLOSE)
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.max_body_bytes:
                return await self._too_large(send)
            if not message.get("more_body"):
                break
        replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def receive_after_body():  # the body as read, then the client's later messages (disconnect)
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_after_body, send)

    async def _receive_unless_closing(self, receive):
        """The client's next message, or None if the server closes first (a body that never comes)."""
        if self.lifecycle is None:
            return await receive()
        if self.lifecycle.closing.is_set():
            return None
        message = asyncio.ensure_future(receive())
        closing = asyncio.ensure_future(self.lifecycle.closing.wait())
        await asyncio.wait({message, closing}, return_when=asyncio.FIRST_COMPLETED)
        closing.cancel()
        if message.done():
            return message.result()
        message.cancel()
        return None

    async def _too_large(self, send) -> None:
        await _send_error(send, 413, f"body: larger than the server's limit of {self.max_body_bytes} bytes "
                                     f"(shardspeed-serve --max-body-bytes)", "body")  # fmt: skip

    def _route(self, scope) -> str | None:
        """The template of the route ``scope`` went to (or would have: a 401 or 413 answered here)."""
        route = scope.get("route")  # set by the router on the way in
        if route is None:
            for candidate in self.routes:
                if candidate.matches(scope)[0] is not Match.NONE:
                    route = candidate
                    break
        return getattr(route, "path", None)

    def _record(self, scope, status: int, seconds: float, details: dict) -> None:
        path = scope["path"]
        if self.metrics is not None:
            self.metrics.request_done(self._route(scope), status)
        if path in ("/health", "/metrics"):
            return  # probes and scrapes would drown the log
        line = {"method": scope["method"], "path": path, "status": status, "ms": round(1000 * seconds, 1)}
        line.update(details)
        access_log.info(json.dumps(line))
