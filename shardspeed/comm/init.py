"""`init_distributed`: start torch.distributed from whatever launched this process."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from shardspeed import accelerator
from shardspeed.comm.discovery import discover
from shardspeed.comm.teardown import quiesce_gloo_workers
from shardspeed.utils.logging import logger

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's name for the default MASTER_PORT


def default_timeout() -> timedelta:
    """30 minutes, or `DEEPSPEED_TIMEOUT` / `SHARDSPEED_TIMEOUT` minutes when set (as DeepSpeed reads it)."""
    minutes = os.environ.get("SHARDSPEED_TIMEOUT", os.environ.get("DEEPSPEED_TIMEOUT", "30"))
    return timedelta(minutes=float(minutes))


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise the default process group once; later calls are no-ops.

    NCCL on CUDA and Gloo on CPU unless `dist_backend` says otherwise. Rank and world size come from the
    environment (torchrun, our launcher, OpenMPI, MPICH/PMI, SLURM) unless given; with no launcher at all
    the process is a world of one. The discovered values are written back into the environment
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) so later code and child tools see one story.
    """
    del config  # accepted for DeepSpeed signature compatibility; the comms logger is not built yet
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialised")
    info = discover(
        os.environ
        if auto_mpi_discovery
        else {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))},
        distributed_port,
    )
    rank = info.rank if rank < 0 else rank
    world_size = info.world_size if world_size < 0 else world_size
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(info.local_rank),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", info.master_addr),
        MASTER_PORT=os.environ.get("MASTER_PORT", str(info.master_port)),
    )
    backend = dist_backend or accelerator.default_backend()
    if verbose and rank == 0:
        logger.info(
            f"initialising torch.distributed: backend={backend} world_size={world_size} "
            f"(from {info.source}) master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        )
    if backend == "nccl":
        accelerator.set_device(accelerator.device_for_local_rank(info.local_rank))
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=rank,
        world_size=world_size,
        timeout=timeout or default_timeout(),
    )
    # We created the group, so we tear it down while the interpreter is still whole; left to finalisation,
    # a Gloo worker thread can abort the finished process (see [Note: Gloo teardown abort] in teardown.py).
    atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    # sys.last_value is set when an uncaught exception ended the script (and after any error in a REPL,
    # hence the sys.ps1 check: an interactive session leaves normally).
    failure = None if hasattr(sys, "ps1") else getattr(sys, "last_value", None)
    if failure is not None and not isinstance(failure, KeyboardInterrupt) and _peers_waiting():
        _exit_failing_rank()
    # Also when the script destroyed the group itself: its worker threads live on until finalisation.
    quiesce_gloo_workers()
    if dist.is_initialized():
        dist.destroy_process_group()


def _peers_waiting() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _exit_failing_rank() -> None:
    """Leave at once after an uncaught exception: the other ranks are blocked until this process is gone.

    Interpreter finalisation with torch loaded takes seconds on a busy machine (measured here: 3-7 s of
    garbage collection), and the launcher can only stop the job once this process has exited. The
    traceback is already printed; streams and logging are flushed, then the process exits with the
    interpreter's own code for an uncaught exception (1). Finalisers and atexit handlers registered
    before `init_distributed` do not run.
    """
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)
