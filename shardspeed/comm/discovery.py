"""Find this process's rank, world size and rendezvous address from the environment.

Launchers describe a job in different dialects: torchrun and our own launcher export RANK/LOCAL_RANK/
WORLD_SIZE/MASTER_ADDR/MASTER_PORT; OpenMPI exports OMPI_COMM_WORLD_*; MPICH and Intel MPI (hydra) export
PMI_*; SLURM exports SLURM_*. `discover` turns any of them into one `ProcessInfo`. With no launcher at all a
plain `python train.py` is a world of one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

TORCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # which dialect described the job: "torch", "openmpi", "mpich", "slurm" or "single"


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError as err:
        raise RuntimeError(f"environment variable {name}={env[name]!r} is not an integer") from err


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in env), None)


def _master_addr(env: Mapping[str, str], single_node: bool, source: str) -> str:
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"]
    if single_node:
        return "127.0.0.1"
    if source == "slurm" and "SLURM_LAUNCH_NODE_IPADDR" in env:
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    raise RuntimeError(
        f"the job was started by {source} across several nodes but MASTER_ADDR is not set; export "
        "MASTER_ADDR=<address of rank 0's node> (the shardspeed launcher does this for you)"
    )


def discover(env: Mapping[str, str] | None = None, distributed_port: int = 29500) -> ProcessInfo:
    """Describe this process from `env` (default `os.environ`)."""
    env = os.environ if env is None else env
    port = int(env.get("MASTER_PORT", distributed_port))
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        return ProcessInfo(rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), port, "torch")
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world
        return ProcessInfo(
            rank, world, local, _master_addr(env, local_size == world, "openmpi"), port, "openmpi"
        )
    rank_key = _first(env, ("PMI_RANK", "PMIX_RANK"))
    if rank_key is not None and "PMI_SIZE" in env:
        rank, world = _int(env, rank_key), _int(env, "PMI_SIZE")
        local_key = _first(env, ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID"))
        local = _int(env, local_key) if local_key else rank
        local_size = _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else None
        single = local_size == world if local_size is not None else local == rank and "MASTER_ADDR" not in env
        return ProcessInfo(rank, world, local, _master_addr(env, single, "mpich"), port, "mpich")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else rank
        single = env.get("SLURM_NNODES", "1") == "1"
        return ProcessInfo(rank, world, local, _master_addr(env, single, "slurm"), port, "slurm")
    return ProcessInfo(0, 1, 0, "127.0.0.1", _free_port() if "MASTER_PORT" not in env else port, "single")


def _free_port() -> int:
    """A free TCP port on loopback, for a world of one that nobody else needs to find."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
