"""`shardspeed report` / `shardspeed-report`: what this machine offers a shardspeed job (like `ds_report`).

Versions and install paths, the torch.distributed backends that are built in, accelerators, /dev/shm
size, which launcher backends are installed, and a short "works here" verdict per feature. There is no
compiled-op table: shardspeed compiles nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys

from shardspeed.launcher import LauncherError
from shardspeed.launcher.multinode import hydra_program

SHM_WARN_BYTES = 512 * 1024**2
LAUNCHER_TOOLS = {
    "ssh": ["ssh"],
    "pdsh": ["pdsh", "ssh"],
    "openmpi": ["mpirun", "ompi_info"],
    "slurm": ["srun"],
}


def _yes(flag: bool) -> str:
    return "[YES]" if flag else "[NO] "


def shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize


def collect() -> list[tuple[str, list[tuple[str, str]]]]:
    """Sections of (name, value) rows; torch is imported here, not at module import."""
    import torch
    import torch.distributed as dist

    import shardspeed

    try:
        from importlib.metadata import version

        ss_version = version("shardspeed")
    except Exception:  # not installed as a distribution (running from a checkout)
        ss_version = getattr(shardspeed, "__version__", "unknown")
    general = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch version", torch.__version__),
        ("torch install path", os.path.dirname(torch.__file__)),
        (
            "torch cuda / hip",
            f"{torch.version.cuda or 'none'} / {getattr(torch.version, 'hip', None) or 'none'}",
        ),
        ("shardspeed version", ss_version),
        ("shardspeed install path", os.path.dirname(shardspeed.__file__ or "")),
        ("platform", platform.platform()),
        ("cpu cores available", str(len(os.sched_getaffinity(0)))),
    ]
    available = dist.is_available()
    backends = [
        ("torch.distributed", _yes(available)),
        ("gloo (CPU)", _yes(available and dist.is_gloo_available())),
        ("nccl (NVIDIA GPU)", _yes(available and dist.is_nccl_available())),
        ("mpi", _yes(available and dist.is_mpi_available())),
    ]
    devices = [("cuda available", _yes(torch.cuda.is_available()))]
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        devices.append((f"cuda:{index}", f"{props.name}, {props.total_memory / 1024**3:.1f} GiB"))
    shm = shm_bytes()
    if shm is None:
        devices.append(("/dev/shm", "not found (dataloader workers and NCCL need shared memory)"))
    else:
        warning = "  WARNING: under 512 MB; raise it (docker: --shm-size=1g)" if shm < SHM_WARN_BYTES else ""
        devices.append(("/dev/shm", f"{shm / 1024**3:.1f} GiB{warning}"))
    launchers = [
        (name, _yes(all(shutil.which(t) for t in tools)) + f" ({', '.join(tools)})")
        for name, tools in LAUNCHER_TOOLS.items()
    ]
    for backend in ("mpich", "impi"):  # both call their launcher mpirun; tell them apart by --version
        try:
            launchers.append((backend, f"[YES] ({hydra_program(backend)})"))
        except LauncherError:
            launchers.append((backend, "[NO]  (no MPICH/Intel MPI hydra mpirun found)"))
    launchers.append(
        (
            "numactl / taskset",
            f"{_yes(bool(shutil.which('numactl')))} / {_yes(bool(shutil.which('taskset')))}",
        )
    )
    gpu = torch.cuda.is_available() and available and dist.is_nccl_available()
    features = [
        ("multi-process training on CPU (gloo)", _yes(available and dist.is_gloo_available())),
        ("multi-GPU training (nccl)", _yes(gpu)),
        ("mixed precision fp16/bf16 on GPU", _yes(torch.cuda.is_available())),
        ("bf16 on CPU", _yes(True)),
        ("multi-node launch over ssh", _yes(bool(shutil.which("ssh")))),
        ("core binding (--bind_cores_to_rank)", _yes(hasattr(os, "sched_setaffinity"))),
    ]
    return [
        ("general environment", general),
        ("torch.distributed backends", backends),
        ("accelerators and memory", devices),
        ("launcher backends", launchers),
        ("features that work here", features),
    ]


def render(sections: list[tuple[str, list[tuple[str, str]]]]) -> str:
    width = max(len(name) for _, rows in sections for name, _ in rows) + 2
    lines = []
    for title, rows in sections:
        lines += ["-" * 60, f"shardspeed report: {title}", "-" * 60]
        lines += [f"{name} {'.' * (width - len(name))} {value}" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardspeed report", description=__doc__.splitlines()[0])
    # Accepted so that scripts calling `ds_report --hide_operator_status` keep working; there are no ops.
    parser.add_argument("--hide_operator_status", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help=argparse.SUPPRESS)
    parser.parse_args(argv)
    print(render(collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
