"""The `shardspeed` command: DeepSpeed's launcher flags, checked up front, then one node or many.

`shardspeed [launcher flags] script.py [script args]` works as `deepspeed ...` does. Everything that can be
wrong with the input (hostfile, filters, conflicting flags, missing tools, unreachable hosts) is reported
as one line naming the problem, with a non-zero exit code, before any process starts.

Single node (or `--no_ssh`): the per-node launcher runs in this process. Several hosts (or
`--force_multi`): a backend from multinode.py starts the per-node launchers or the ranks on every host.
`shardspeed report` prints the environment report (report.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import signal
import socket
import sys

from shardspeed.launcher import LauncherError, fast_exit, log
from shardspeed.launcher.env import exported_env, read_env_files
from shardspeed.launcher.hostfile import (
    Resources,
    apply_filters,
    check_host_name,
    encode_world_info,
    parse_hostfile_text,
    read_hostfile,
    select_resources,
)

DEFAULT_HOSTFILE = "/job/hostfile"
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # DeepSpeed's name; Accelerate's launcher imports it
DEFAULT_LAUNCHER = "ssh"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardspeed",
        description="Launch a training script on one or more nodes (flags as DeepSpeed's `deepspeed`).",
        epilog="`shardspeed report` prints the environment report. See docs/launcher.md.",
    )
    p.add_argument("-H", "--hostfile", default=None, help=f"MPI-style hostfile (default {DEFAULT_HOSTFILE})")
    p.add_argument("-i", "--include", default="", help="only these hosts/slots: host[:slot,slot][@host...]")
    p.add_argument(
        "-e", "--exclude", default="", help="all but these hosts/slots: host[:slot,slot][@host...]"
    )
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                   help="processes per node (slots 0..N-1); without GPUs, N CPU processes")  # fmt: skip
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--master_addr", default="", help="rank 0's address (default: inferred)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index, with --no_ssh")
    p.add_argument(
        "--launcher", default=DEFAULT_LAUNCHER, help="ssh (default), pdsh, openmpi, mpich, impi, slurm"
    )
    p.add_argument("--launcher_args", default="", help="one string, split like a shell, added to the backend")
    p.add_argument("--module", action="store_true", help="run the script as `python -m module`")
    p.add_argument(
        "--no_python", action="store_true", help="run the script as an executable, not with python"
    )
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    p.add_argument("--no_ssh", action="store_true", help="start only this node's ranks (schedulers)")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check")
    p.add_argument("--force_multi", action="store_true", help="use the multi-node backend even for one host")
    p.add_argument("--save_pid", action="store_true", help="write the launcher pid to /tmp/<pid>.deepspeed")
    p.add_argument(
        "--enable_each_rank_log", default="None", help="write each rank's output to DIR/<time>_rank<R>.log"
    )
    p.add_argument("--autotuning", default="", choices=["tune", "run"],
                   help="search configs by short runs (tune), then train with the best (run); docs/autotuning")  # fmt: skip
    p.add_argument("--elastic_training", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of cores")
    p.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. 0,2-5 (implies binding)")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port for every connection")
    p.add_argument("user_script", help="the training script (or module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments, passed untouched")
    return p


def parse_resource_filter(host_info: Resources, include_str: str = "", exclude_str: str = "") -> Resources:
    """DeepSpeed's name: `host_info` ({host: [slots]}) narrowed by an --include or --exclude string.

    A ValueError names a bad filter (unknown host or slot, both given, bad syntax); a filter that leaves
    nothing gives {} here, while the launcher itself refuses to start with no slots.
    """
    try:
        return apply_filters(dict(host_info), include_str, exclude_str)
    except LauncherError as error:
        if "leave no slots" in str(error):
            return {}
        raise ValueError(str(error)) from None


def _parse_hostfile(lines: list[str]) -> dict[str, int]:
    """DeepSpeed's helper: {host: slot count} from hostfile lines; a ValueError names the bad line."""
    try:
        return parse_hostfile_text("\n".join(lines))
    except LauncherError as error:
        raise ValueError(str(error)) from None


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """The launcher's flags parsed (DeepSpeed's `deepspeed.launcher.runner.parse_args`)."""
    return build_parser().parse_args(args)


def check_flags(args: argparse.Namespace) -> None:
    """Conflicts between flags alone, before any file or host is looked at."""
    check_conflicts(args)
    check_values(args)


def check_conflicts(args: argparse.Namespace) -> None:
    if args.elastic_training or args.min_elastic_nodes > 0 or args.max_elastic_nodes > 0:
        raise LauncherError("elastic training (--elastic_training, --min/max_elastic_nodes) is not supported")
    if args.module and args.no_python:
        raise LauncherError("--module and --no_python cannot be used together")
    if args.node_rank >= 0 and not args.no_ssh:
        raise LauncherError("--node_rank is only used with --no_ssh (one launcher started per node)")
    if args.no_ssh and args.force_multi:
        raise LauncherError("--no_ssh and --force_multi cannot be used together")
    if args.include and args.exclude:
        raise LauncherError("--include and --exclude cannot be used together")
    if (args.num_nodes > 0 or args.num_gpus > 0) and (args.include or args.exclude):
        raise LauncherError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")


def check_values(args: argparse.Namespace) -> None:
    for flag, value in (("--num_nodes", args.num_nodes), ("--num_gpus", args.num_gpus)):
        if value == 0 or value < -1:
            raise LauncherError(f"{flag} must be a positive number, got {value}")
    if args.master_addr:
        check_host_name(args.master_addr, "--master_addr")
    for flag, port in (("--master_port", args.master_port), ("--ssh_port", args.ssh_port)):
        if port is not None and not 0 < port < 65536:
            raise LauncherError(f"{flag} must be between 1 and 65535, got {port}")
    args.launcher = args.launcher.lower()
    from shardspeed.launcher.multinode import BACKENDS  # here, so that `--help` stays light

    if args.launcher == "mvapich":
        raise LauncherError(
            "--launcher mvapich is not supported; MVAPICH2's hydra works with --launcher mpich"
        )
    if args.launcher not in BACKENDS:
        raise LauncherError(f"unknown --launcher {args.launcher!r}; choose one of {', '.join(BACKENDS)}")
    try:
        args.launcher_args = shlex.split(args.launcher_args)
    except ValueError as err:
        raise LauncherError(f"--launcher_args {args.launcher_args!r}: {err}") from None


def local_device_count() -> int:
    """GPUs on this machine; 0 without importing torch when there is no GPU driver at all."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        return 0
    import torch  # slow; only when a GPU driver is present

    return torch.cuda.device_count()


def local_slots(args: argparse.Namespace) -> list[int]:
    """This machine's slots when there is no hostfile."""
    if args.num_gpus > 0:
        return list(range(args.num_gpus))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        return [int(v) for v in visible.split(",")]  # the per-node launcher sets it again for the ranks
    count = local_device_count()
    if count == 0:
        log.info("no GPU found and no --num_gpus: starting 1 CPU process (use --num_gpus N for N processes)")
        return [0]
    return list(range(count))


def resolve_resources(args: argparse.Namespace) -> tuple[Resources, bool]:
    """(resources, whether they came from a hostfile)."""
    path = args.hostfile or DEFAULT_HOSTFILE
    if args.hostfile is None and not os.path.exists(path):
        log.info(f"no hostfile at {path}: using this machine only")
        if args.num_nodes > 1:
            raise LauncherError(f"--num_nodes {args.num_nodes} needs a hostfile (none at {path})")
        pool = {"localhost": local_slots(args)}
        return select_resources(pool, args.include, args.exclude, -1, args.num_gpus), False
    hosts = read_hostfile(path)  # an explicitly named hostfile must exist
    pool = {host: list(range(count)) for host, count in hosts.items()}
    return select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus), True


def launch_flags(args: argparse.Namespace) -> list[str]:
    """The flags every per-node launcher gets, whichever way it is started."""
    flags = [
        name for name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank") if getattr(args, name)
    ]
    flags = [f"--{name}" for name in flags]
    if args.save_pid:
        flags.append(f"--save_pid={os.getpid()}")
    if args.enable_each_rank_log not in (None, "None"):
        flags.append(f"--enable_each_rank_log={os.path.abspath(args.enable_each_rank_log)}")
    if args.bind_core_list:
        flags.append(f"--bind_core_list={args.bind_core_list}")
    return flags


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
        try:
            sock.bind(("", port))
        except OSError:
            raise LauncherError(f"--master_port {port} is already in use here; pick another port") from None


def run_single_node(args: argparse.Namespace, resources: Resources) -> int:
    from shardspeed.launcher import launch

    if args.no_ssh and len(resources) > 1 and args.node_rank < 0:
        raise LauncherError(
            f"--no_ssh with {len(resources)} hosts needs --node_rank (0..{len(resources) - 1})"
        )
    node_rank = max(args.node_rank, 0)
    if not 0 <= node_rank < len(resources):
        raise LauncherError(
            f"--node_rank {node_rank} is outside 0..{len(resources) - 1} ({len(resources)} hosts)"
        )
    master_addr = args.master_addr
    if not master_addr and len(resources) == 1:
        master_addr = "127.0.0.1"
    elif not master_addr:
        from shardspeed.launcher.multinode import JobPlan, infer_master_addr

        master_addr = infer_master_addr(JobPlan(resources, "", 0, "", []), use_ssh=False)
        log.warning(f"--no_ssh without --master_addr: using {master_addr}; every node must agree on it")
    if len(resources) == 1 and _is_loopback(master_addr):
        check_port_free(args.master_port)
    os.environ.update(read_env_files(os.environ, os.getcwd(), os.path.expanduser("~")))
    argv = [
        f"--world_info={encode_world_info(resources)}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={args.master_port}",
        *launch_flags(args),
        args.user_script,
        *args.user_args,
    ]
    node_args = launch.build_parser().parse_args(argv)
    world = sum(len(s) for s in resources.values())
    log.info(f"starting {len(resources[list(resources)[node_rank]])} of {world} ranks on this node")
    return launch.run_node(node_args)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def run_multi_node(args: argparse.Namespace, resources: Resources) -> int:
    from shardspeed.launcher import launch, multinode
    from shardspeed.launcher.supervise import Supervisor

    multinode.check_installed(args.launcher)
    plan = multinode.JobPlan(
        resources=resources,
        master_addr=args.master_addr,
        master_port=args.master_port,
        script=args.user_script,
        script_args=list(args.user_args),
        launch_flags=launch_flags(args),
        exports=exported_env(),
        launcher_args=args.launcher_args,
        ssh_port=args.ssh_port,
        ssh_config=os.environ.get("SHARDSPEED_SSH_CONFIG") or None,
    )
    if plan.ssh_config and not os.path.isfile(plan.ssh_config):
        raise LauncherError(f"SHARDSPEED_SSH_CONFIG={plan.ssh_config} is not a file")
    launch.check_script(args_for_script_check(args))
    if not args.no_ssh_check and args.launcher != "slurm":
        multinode.probe_hosts(list(resources), plan)
    if not plan.master_addr:
        plan.master_addr = multinode.infer_master_addr(plan, use_ssh=args.launcher != "slurm")
    workers = multinode.WORKERS[args.launcher](plan)
    log.info(f"{args.launcher}: {plan.world_size} ranks on {len(resources)} hosts: {', '.join(resources)}")
    return Supervisor(workers, grace=launch.grace_seconds()).run()


def args_for_script_check(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(module=args.module, no_python=args.no_python, training_script=args.user_script)


def run_autotuning(args: argparse.Namespace, resources: Resources) -> int:
    """`--autotuning tune|run`: experiments through this launcher, results in autotuning_results/ (DeepSpeed's
    flow); `run` then trains with the best config."""
    from shardspeed.autotuning import Autotuner, AutotuningError
    from shardspeed.config import ConfigError

    # SIGTERM ends the search like Ctrl-C: the running experiment (in its own session) is stopped with it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        tuner = Autotuner(args, resources)
        log.info("autotuning: start")
        tuner.tune()
    except (AutotuningError, ConfigError) as err:
        raise LauncherError(f"--autotuning {args.autotuning}: {err}") from None
    tuner.print_tuning_results()
    tuner.write_optimal_config()
    if tuner.optimal_cmd is None:
        log.error(
            "autotuning: no experiment ran successfully (see summary.txt and each experiment's stderr.log)"
        )
        return 1
    return tuner.run_after_tuning() if args.autotuning == "run" else 0


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    resources, _ = resolve_resources(args)
    if args.autotuning:
        return run_autotuning(args, resources)
    if (args.force_multi or len(resources) > 1) and not args.no_ssh:
        return run_multi_node(args, resources)
    return run_single_node(args, resources)


def main(argv: list[str] | None = None, *, args: list[str] | None = None) -> int:
    """Console-script entry point; called without `argv` it exits the process itself (see `fast_exit`).

    `main(args=[...])` is DeepSpeed's programmatic form: there a bad command line raises `LauncherError` (a
    ValueError naming the problem, as DeepSpeed raises) instead of being printed as an exit status."""
    if args is not None:
        if argv is not None:
            raise TypeError("main: give argv or args, not both")
        return run(list(args))
    as_command = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"] and not os.path.exists("report"):
        from shardspeed.launcher import report

        return report.main(argv[1:])
    try:
        code = run(argv)
    except LauncherError as err:
        print(f"shardspeed: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C while checking hosts, before any rank started
        print("shardspeed: interrupted", file=sys.stderr)
        code = 130
    return fast_exit(code) if as_command else code


if __name__ == "__main__":
    sys.exit(main())
