"""Per-node launcher: start this node's ranks and supervise them (`python -u -m shardspeed.launcher.launch`).

The runner calls `main` in-process for a single-node job and starts it over ssh/pdsh on every node of a
multi-node job; the flags are DeepSpeed's `deepspeed.launcher.launch` flags, plus:

- `--stop_on_stdin_eof`: the runner's ssh channel is our stdin; end-of-file means the runner has gone or
  wants the job stopped, so the ranks are stopped (see [Note: job teardown] in supervise.py).
- `--rank_from_scheduler`: we are one rank started by mpirun/srun; translate the scheduler's variables
  (OMPI_COMM_WORLD_*, PMI_*, SLURM_*) into the env contract below and exec the user's script in place.

Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK (node index), CROSS_SIZE (nodes),
MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES (this node's slots; each rank sees them all and picks its
device by LOCAL_RANK, as with DeepSpeed) and `--local_rank=N` unless `--no_local_rank`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Mapping

from shardspeed.launcher import LauncherError, fast_exit
from shardspeed.launcher.hostfile import Resources, decode_world_info, parse_core_list
from shardspeed.launcher.supervise import Supervisor, Worker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shardspeed.launcher.launch",
        description="Start and supervise the ranks of one node (normally run by the `shardspeed` command).",
    )
    p.add_argument("--node_rank", type=int, default=0, help="index of this node in --world_info")
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--world_info", default=None, help="urlsafe base64 of JSON {host: [slot, ...]}")
    p.add_argument("--module", action="store_true", help="run the script as `python -m module`")
    p.add_argument("--no_python", action="store_true", help="run the script as an executable")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    p.add_argument("--save_pid", type=int, default=0, help="write our pid to /tmp/<SAVE_PID>.deepspeed")
    p.add_argument("--enable_each_rank_log", default="None", help="directory for one log file per rank")
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None, help="cores to split among the ranks, e.g. 0,2-5")
    p.add_argument("--stop_on_stdin_eof", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank_from_scheduler", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def check_script(args: argparse.Namespace) -> None:
    if args.module and args.no_python:
        raise LauncherError("--module and --no_python cannot be used together")
    script = args.training_script
    if args.module:
        return  # resolved by the interpreter on each node
    if args.no_python:
        if os.sep in script and not (os.path.isfile(script) and os.access(script, os.X_OK)):
            raise LauncherError(f"--no_python: {script} is not an executable file")
        if os.sep not in script and shutil.which(script) is None:
            raise LauncherError(f"--no_python: {script!r} is not a file here nor a command on PATH")
    elif not os.path.isfile(script):
        raise LauncherError(f"training script {script!r} not found (working directory {os.getcwd()})")


def rank_command(args: argparse.Namespace, local_rank: int) -> list[str]:
    command = [] if args.no_python else [sys.executable, "-u"] + (["-m"] if args.module else [])
    command.append(args.training_script)
    if not args.no_local_rank:
        command.append(f"--local_rank={local_rank}")
    return command + list(args.training_script_args)


def split_cores(args: argparse.Namespace, ranks: int, environ: Mapping[str, str]) -> list[list[int]] | None:
    """Each local rank's share of the cores, or None without binding; errors before anything starts."""
    if not (args.bind_cores_to_rank or args.bind_core_list):
        return None
    if "KMP_AFFINITY" in environ:
        raise LauncherError("--bind_cores_to_rank conflicts with KMP_AFFINITY in the environment; unset one")
    allowed = sorted(os.sched_getaffinity(0))
    cores = parse_core_list(args.bind_core_list) if args.bind_core_list else allowed
    outside = [c for c in cores if c not in allowed]
    if outside:
        raise LauncherError(f"--bind_core_list: cores {outside} are not available here (allowed: {allowed})")
    per_rank = len(cores) // ranks
    if per_rank == 0:
        raise LauncherError(f"--bind_cores_to_rank: {len(cores)} core(s) cannot be split among {ranks} ranks")
    return [cores[i * per_rank : (i + 1) * per_rank] for i in range(ranks)]


def rank_env(
    base: Mapping[str, str],
    world: Resources,
    node_rank: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    hosts = list(world)
    slots = world[hosts[node_rank]]
    first_rank = sum(len(world[h]) for h in hosts[:node_rank])
    env = dict(base)
    env.update(
        CUDA_VISIBLE_DEVICES=",".join(str(s) for s in slots),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(sum(len(s) for s in world.values())),
        CROSS_RANK=str(node_rank),
        CROSS_SIZE=str(len(hosts)),
        LOCAL_SIZE=str(len(slots)),
        RANK=str(first_rank + local_rank),
        LOCAL_RANK=str(local_rank),
    )
    return env


def node_workers(args: argparse.Namespace, world: Resources) -> list[Worker]:
    if not 0 <= args.node_rank < len(world):
        raise LauncherError(
            f"--node_rank {args.node_rank} is outside 0..{len(world) - 1} ({len(world)} nodes)"
        )
    ranks = len(world[list(world)[args.node_rank]])
    cores = split_cores(args, ranks, os.environ)
    log_dir = None if args.enable_each_rank_log in (None, "None") else args.enable_each_rank_log
    if log_dir:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as err:
            raise LauncherError(f"--enable_each_rank_log: cannot create {log_dir}: {err.strerror}") from None
    stamp = time.strftime("%Y%m%d%H%M%S")
    workers = []
    for local in range(ranks):
        env = rank_env(os.environ, world, args.node_rank, local, args.master_addr, args.master_port)
        if cores:
            env["OMP_NUM_THREADS"] = str(len(cores[local]))
        elif "OMP_NUM_THREADS" not in env:
            # Without a limit every rank starts one intra-op thread per core, and N ranks oversubscribe the
            # machine N times over (seen here: 4x slower with 2 ranks on 2 cores). Share the cores instead.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
        rank = int(env["RANK"])
        workers.append(
            Worker(
                name=f"rank {rank}",
                argv=rank_command(args, local),
                env=env,
                log_path=os.path.join(log_dir, f"{stamp}_rank{rank}.log") if log_dir else None,
                inherit_stdin=not args.stop_on_stdin_eof,
                cpus=cores[local] if cores else None,
            )
        )
    return workers


def grace_seconds() -> float:
    try:
        return float(os.environ.get("SHARDSPEED_STOP_GRACE", "1.0"))
    except ValueError:
        raise LauncherError("SHARDSPEED_STOP_GRACE must be a number of seconds") from None


def run_node(args: argparse.Namespace) -> int:
    if args.world_info is None:
        raise LauncherError("--world_info is required")
    world = decode_world_info(args.world_info)
    check_script(args)
    workers = node_workers(args, world)
    pid_file = f"/tmp/{args.save_pid}.deepspeed" if args.save_pid else None
    if pid_file:
        with open(pid_file, "w") as handle:
            handle.write(f"{os.getpid()}\n")
    try:
        supervisor = Supervisor(workers, grace=grace_seconds(), stop_on_stdin_eof=args.stop_on_stdin_eof)
        return supervisor.run()
    finally:
        if pid_file:
            with contextlib.suppress(OSError):
                os.remove(pid_file)


def _scheduler_rank(env: Mapping[str, str]) -> tuple[int, int, int | None]:
    """(rank, world size, local rank or None) from OpenMPI, MPICH/Intel MPI (PMI) or SLURM variables."""
    for rank_key, size_key, local_key in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("PMIX_RANK", "PMI_SIZE", "PALS_LOCAL_RANKID"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        if rank_key in env and size_key in env:
            local = env.get(local_key)
            return int(env[rank_key]), int(env[size_key]), None if local is None else int(local)
    raise LauncherError("--rank_from_scheduler: no OMPI_COMM_WORLD_*, PMI_* or SLURM_* variables found")


def exec_from_scheduler(args: argparse.Namespace) -> None:
    """Become the user's script with our env contract, for ranks that mpirun or srun started."""
    if args.world_info is None:
        raise LauncherError("--world_info is required")
    check_script(args)
    world = decode_world_info(args.world_info)
    rank, size, sched_local = _scheduler_rank(os.environ)
    total = sum(len(s) for s in world.values())
    if size != total:
        raise LauncherError(f"the scheduler started {size} ranks but the job has {total} slots")
    offset, node_rank = 0, 0
    for node_rank, host in enumerate(world):  # noqa: B007 (node_rank is used after the loop)
        if rank < offset + len(world[host]):
            break
        offset += len(world[host])
    local = rank - offset
    if sched_local is not None and sched_local != local:
        raise LauncherError(
            f"rank {rank} runs as local rank {sched_local} but the host order implies {local}; the "
            "scheduler must place ranks host by host (block mapping)"
        )
    env = rank_env(os.environ, world, node_rank, local, args.master_addr, args.master_port)
    command = rank_command(args, local)
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        raise LauncherError(f"rank {rank}: cannot run {command[0]}: {err.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.rank_from_scheduler:
            exec_from_scheduler(args)
        return run_node(args)
    except LauncherError as err:
        print(f"shardspeed launch: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    fast_exit(main())
