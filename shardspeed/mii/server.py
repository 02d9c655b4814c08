"""``shardspeed-serve``: a Hugging Face causal-LM directory behind an OpenAI-compatible HTTP server.

    shardspeed-serve path/to/model --port 28080 [--tensor-parallel 2] [--api-key KEY]

This module is the command: its arguments (``--help`` works without the ``serve`` extra), loading the
model (``load_engine``, the one place it happens), the generation loop on a thread (engine_loop.py) and
uvicorn serving the FastAPI app (app.py). Lifecycle:
  * SIGTERM / Ctrl-C: the server drains (lifecycle.py): ``/health`` answers 503 and new generations get
    503 while requests in flight get ``--shutdown-timeout`` seconds to finish; those still running then
    end with an answer (a stream: an error event and ``data: [DONE]``; a plain request: 503); then uvicorn
    closes, the generation loop stops and the process exits 0 at once (``os._exit``: the interpreter's
    teardown is skipped, it can take seconds);
  * the generation loop dies (a bug, not one bad request: those end alone): pending requests get an
    error, ``/health`` says "failed", the server shuts down the same way and the process exits 1, for a
    supervisor to restart it;
  * ``--tensor-parallel N`` restarts the command through shardspeed's launcher on N local ranks; rank 0
    serves HTTP, the others follow its rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading

__all__ = ["load_engine", "main"]

logger = logging.getLogger("shardspeed.mii.server")


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        "shardspeed-serve",
        description="Serve a Hugging Face causal LM over HTTP (OpenAI's API and MII's route)",
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
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="do not share the KV blocks of common prompt prefixes between requests")  # fmt: skip
    parser.add_argument("--api-key", default=os.environ.get("SHARDSPEED_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 and /mii (default: $SHARDSPEED_API_KEY)")  # fmt: skip
    parser.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024, help="larger bodies get 413")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds in-flight requests get to finish after SIGTERM before they are ended "
                        "(a stream with an error event, a plain request with 503)")  # fmt: skip
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="'info' writes one JSON line per request to stderr")  # fmt: skip
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


def load_engine(args):
    """(engine, tokenizer) for the command's model directory: the one place the server loads a model."""
    import torch

    from .pipeline import load_model

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    return load_model(
        args.model_dir, tensor_parallel=args.tensor_parallel, dtype=dtype, max_out_tokens=args.max_tokens
    )


def _missing_serve_extra() -> str | None:
    for module in ("fastapi", "uvicorn", "prometheus_client", "transformers"):
        try:
            __import__(module)
        except ImportError:
            return module
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    missing = _missing_serve_extra()
    if missing:
        print(f"shardspeed-serve: {missing} is not installed; install the serve extra: pip install 'shardspeed[serve]'",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.tensor_parallel > 1 and "RANK" not in os.environ:
        return _relaunch_under_launcher(args, argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("shardspeed.mii").setLevel(args.log_level.upper())  # shardspeed's logger is at INFO
    # Every log line on stderr, as --help says: shardspeed's package logger writes to stdout (DeepSpeed's
    # habit, which training output follows), and the request log goes through it.
    from shardspeed.utils.logging import logger as package_logger  # creates its handler if not yet there

    for handler in package_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    from shardspeed.inference.scheduler import ContinuousBatcher

    from .engine_loop import EngineLoop

    engine, tokenizer = load_engine(args)
    batcher = ContinuousBatcher(engine.decoder, max_len=engine.config.max_out_tokens, max_batch=args.max_batch,
                                prefix_caching=args.prefix_caching)  # fmt: skip
    loop = EngineLoop(batcher, engine.mp_group)
    if engine.tp_rank != 0:
        loop.follow()
        return 0
    return _serve(args, engine, tokenizer, loop)


def _uvicorn_server(config, lifecycle):
    """uvicorn's server, with the shutdown of lifecycle.py: the first SIGTERM/SIGINT drains (the listener
    stays open, /health answers 503, work in flight finishes or is ended with an answer) and only then does
    uvicorn close; a second one shortens the drain. And uvicorn does not raise the signal again once it has
    shut down, or the process would die by it before the generation loop is stopped: the command finishes
    its shutdown and exits with its own status."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        drain: asyncio.Future | None = None
        drain_asked = False

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            # A signal handler: only flags here; the drain itself runs on the event loop (on_tick).
            if self.drain_asked:
                lifecycle.hurry()
            self.drain_asked = True

        async def on_tick(self, counter: int) -> bool:  # uvicorn calls this every 0.1 s
            if self.drain_asked and self.drain is None:
                self.drain = asyncio.ensure_future(lifecycle.drain())
            if self.drain is not None and self.drain.done():
                self.should_exit = True
            return await super().on_tick(counter)

    return Server(config)


def _serve(args, engine, tokenizer, loop) -> int:
    import uvicorn

    from .app import create_app
    from .metrics import ServerMetrics
    from .service import GenerationService

    name = args.deployment_name or os.path.basename(os.path.normpath(args.model_dir))
    metrics = ServerMetrics(loop.batcher, name)
    service = GenerationService(engine, tokenizer, loop, name, metrics)
    app = create_app(service, metrics=metrics, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     shutdown_timeout=args.shutdown_timeout)  # fmt: skip
    lifecycle = app.state.lifecycle
    # uvicorn's own grace only backs the drain up: when uvicorn closes, everything has been answered.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=lifecycle.grace)  # fmt: skip
    server = _uvicorn_server(config, lifecycle)

    def loop_died(_error) -> None:  # called on the loop's thread: uvicorn polls should_exit
        server.should_exit = True

    loop.on_failure = loop_died
    loop.start()
    logger.info("serving %s on http://%s:%d (prefix caching %s)", name, args.host, args.port,
                "on" if args.prefix_caching else "off")  # fmt: skip
    try:
        server.run()
    finally:
        loop.stop(timeout=args.shutdown_timeout)
    code = 0 if server.started else 1
    if loop.error is not None:
        logger.critical("exiting with status 1: the generation loop failed (%r)", loop.error)
        code = 1
    # Leave now: everything is answered or cancelled, and the interpreter's own teardown (torch,
    # tokenizers, the loop thread if it is stuck in a step) can take many seconds on a loaded machine.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
