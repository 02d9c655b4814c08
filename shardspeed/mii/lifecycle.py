"""The server's shutdown: after SIGTERM it drains, so that every request in flight gets a whole answer.

``Lifecycle.state`` goes SERVING -> DRAINING -> CLOSING -> CLOSED:
  * DRAINING (``drain()`` started, by the first SIGTERM or Ctrl-C): the listener stays open; ``/health``
    answers 503 "stopping"; a new generation request gets 503 at once; requests in flight (``in_flight``,
    counted by guard.py) get ``timeout`` seconds to finish;
  * CLOSING: every generation still running is ended (``GenerationService.abort_all``): a stream with an
    error event (OpenAI's error body, 503) and ``data: [DONE]``, a plain request with a 503; a request still
    sending its body gets a 503 (``closing`` is set); those answers get ``grace`` seconds to go out;
  * CLOSED: ``drain()`` returns and the HTTP server may close (server.py): nothing is left for it to cut.
A second signal ends the wait of DRAINING at once (``hurry``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

__all__ = ["Lifecycle", "State"]

logger = logging.getLogger("shardspeed.mii.server")

SHUTTING_DOWN = "the server is shutting down"


class State(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # no new work; work in flight may finish
    CLOSING = "closing"  # work in flight ended by the server; its answers are going out
    CLOSED = "closed"


class Lifecycle:
    """The drain of one server (module docstring); ``service`` is its ``GenerationService``."""

    def __init__(self, service, timeout: float = 5.0, grace: float = 2.0, poll_s: float = 0.05):
        self.service, self.timeout, self.grace, self.poll_s = service, timeout, grace, poll_s
        self.state = State.SERVING
        self.in_flight = 0  # HTTP requests being answered; probes, scrapes and the schema not counted
        self.closing = asyncio.Event()  # set on CLOSING: requests still reading a body give up
        self._hurry = False

    @property
    def serving(self) -> bool:
        return self.state is State.SERVING

    def hurry(self) -> None:
        """Stop waiting for work in flight (a second signal)."""
        self._hurry = True

    async def _wait(self, seconds: float) -> None:
        """Until no request is in flight, ``seconds`` have passed or ``hurry`` was called."""
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(self.poll_s)

    async def drain(self) -> None:
        if not self.serving:
            return
        self.state = State.DRAINING
        self.service.accepting = False
        logger.info("draining: %d request(s) in flight get %.1f s to finish", self.in_flight, self.timeout)
        await self._wait(self.timeout)
        self.state = State.CLOSING
        self.closing.set()
        ended = self.service.abort_all(SHUTTING_DOWN)
        if ended:
            logger.info("draining: %d generation(s) still running were ended with an error", ended)
        self._hurry = False  # the answers just made still get their grace
        await self._wait(self.grace)
        if self.in_flight:
            logger.warning(
                "draining: %d request(s) still unanswered after %.1f s", self.in_flight, self.grace
            )
        self.state = State.CLOSED
