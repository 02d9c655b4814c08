"""The multi-rank test harness every distributed test uses.

`run_ranks(fn, world_size, *args)` starts `world_size` spawned processes on loopback, each with the env
contract a launcher gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), runs `fn(*args)` in each
and returns the per-rank results. A rank that raises fails the test with that rank's traceback; a rank that
dies or hangs fails it too (after `timeout` seconds), and every other rank is terminated — no silent hangs.
`fn` must be a module-level function (spawned processes import it by name).

The ranks start from a fork server that has already imported torch and shardspeed (FORKSERVER_PRELOAD): a rank
then starts in milliseconds instead of paying torch's import (2-3 CPU-seconds) again, which over the suite's
hundreds of ranks was most of its time on a small machine. It keeps spawn's guarantees: the server forks before
any thread or process group exists, and each rank takes the caller's environment as it is at `run_ranks` (the
server's own environment is the one it started with).
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import torch


class RankFailure(AssertionError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Imported once in the fork server, inherited by every rank it forks.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "shardspeed"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _child(fn, rank: int, world_size: int, port: int, args, results, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the fork server's at its start
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SHARDSPEED_TIMEOUT="2",
    )  # fmt: skip
    torch.set_num_threads(1)
    try:
        value = fn(*args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        # A forked process ends with os._exit, which skips atexit; a launched rank (and a spawned one) runs
        # it, and shardspeed's end-of-process clean-up (swap folders) lives there.
        atexit._run_exitfuncs()


def error_text(fn) -> str:
    """ "<ExceptionType>: <message>" of what `fn()` raises, or "no error" (picklable, for a rank's result)."""
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, dict(os.environ)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise RankFailure(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise RankFailure(
                        f"ranks {missing} did not finish within {timeout:.0f} s (hang?)"
                    ) from None
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} raised:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(world_size)]
