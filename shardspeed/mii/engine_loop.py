"""The server's generation thread: one ``ContinuousBatcher`` stepped in the background, in lockstep over ranks.

HTTP handlers call ``submit``/``cancel`` (thread-safe: they only queue commands). The loop thread drains
the commands, applies them and runs one batcher round. With tensor parallelism every rank holds a part of
each layer, so every rank must run exactly the same rounds: rank 0 (the HTTP rank) broadcasts each round's
commands over the tensor group, the other ranks (``follow``) apply them and step too. Greedy tokens are then
identical on every rank (the row-parallel all-reduce gives every rank the same logits) and sampled ones too
(each request's generator is seeded the same on every rank). While idle, rank 0 still broadcasts an empty
round every ``idle_s`` seconds, so the other ranks never sit in a collective long enough to time out.

A request that fails ends alone (the batcher sees to that). If the loop itself dies, every pending request
is answered with an error, ``error`` is set (``/health`` reports it) and ``on_failure`` is called: the
server then exits non-zero, for a supervisor to restart it, instead of answering 500 forever. ``stop``
ends every pending request ("the server is shutting down") and the thread within ``timeout`` seconds.
"""

from __future__ import annotations

import logging
import pickle
import threading

import torch.distributed as dist

from shardspeed.comm.collectives import broadcast_bytes
from shardspeed.inference.scheduler import BatchRequest, ContinuousBatcher

__all__ = ["EngineLoop"]

_STOP = "stop"

logger = logging.getLogger(__name__)


class EngineLoop:
    """Runs ``batcher`` on a thread (rank 0) or in the caller (``follow``, other tensor-parallel ranks)."""

    def __init__(self, batcher: ContinuousBatcher, group=None, idle_s: float = 0.05, on_failure=None):
        self.batcher = batcher
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.idle_s = idle_s
        self._inbox: list = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._by_id: dict[int, BatchRequest] = {}
        self.error: BaseException | None = None
        self.on_failure = on_failure
        self.stopping = False  # no new requests: set by ``stop``

    # ---- rank 0 -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shardspeed-generation", daemon=True)
        self._thread.start()

    def submit(self, request: BatchRequest) -> None:
        if self.error is not None:
            raise RuntimeError(f"the generation loop failed: {self.error!r}")
        with self._lock:
            self._inbox.append(("add", request))
        self._wake.set()

    def cancel(self, request: BatchRequest) -> None:
        with self._lock:
            self._inbox.append(("cancel", request.id))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                logger.warning(
                    "generation loop: still in a step after %.0f s; leaving it (daemon thread)", timeout
                )

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    commands, self._inbox = self._inbox, []
                stopping = self._stop  # read once: the round's broadcast and its exit must agree
                if stopping:
                    commands = [(_STOP, None)]
                wire = [self._wire(cmd) for cmd in commands]
                if self.group is not None:
                    broadcast_bytes(
                        pickle.dumps(wire), src=dist.get_global_rank(self.group, 0), group=self.group
                    )
                if stopping:
                    self.batcher.abort_all("the server is shutting down")
                    return
                self._apply(commands)
                busy = self.batcher.step()
                self._prune()
                if not busy and not commands:
                    self._wake.wait(self.idle_s)
                    self._wake.clear()
        except BaseException as error:
            self._died(error)

    def _died(self, error: BaseException) -> None:
        self.error = error
        logger.critical("generation loop died: %r", error, exc_info=error)
        try:  # answer whoever waits; the batcher's state may be broken, so this is best effort
            self.batcher.abort_all(f"the generation loop failed: {error!r}")
        except Exception:
            logger.exception("generation loop: could not end the pending requests")
        if self.on_failure is not None:
            self.on_failure(error)

    @staticmethod
    def _wire(command):
        kind, value = command
        if kind == "add":  # the other ranks need the request's content, not its callback
            return ("add", (value.id, value.prompt_ids, value.settings, value.seed))
        return command

    def _apply(self, commands) -> None:
        for kind, value in commands:
            if kind == "add":
                try:
                    self.batcher.submit(value)
                    self._by_id[value.id] = value
                except ValueError as error:
                    value.finish_reason, value.error = "error", str(error)
                    value.emit(-1, "error")
            elif kind == "cancel" and value in self._by_id:
                self.batcher.cancel(self._by_id.pop(value))

    # ---- ranks 1.. --------------------------------------------------------------------------------
    def follow(self) -> None:
        """Apply rank 0's rounds until it stops (the other tensor-parallel ranks' main loop)."""
        while True:
            try:
                wire = broadcast_bytes(None, src=dist.get_global_rank(self.group, 0), group=self.group)
            except RuntimeError as error:  # rank 0 stopped (a shutdown signal reaches every rank at once)
                logger.warning("generation loop: rank 0 went away (%s); stopping", str(error).splitlines()[0])
                return
            commands = []
            for kind, value in pickle.loads(wire):  # rank 0 of this job: trusted
                if kind == _STOP:
                    return
                if kind == "add":
                    request_id, prompt_ids, settings, seed = value
                    request = BatchRequest(prompt_ids, settings, emit=lambda token, reason: None, seed=seed)
                    request.id = request_id
                    commands.append(("add", request))
                else:
                    commands.append((kind, value))
            self._apply(commands)
            self.batcher.step()
            self._prune()

    def _prune(self) -> None:
        if any(r.finish_reason is not None for r in self._by_id.values()):
            self._by_id = {i: r for i, r in self._by_id.items() if r.finish_reason is None}
