"""Multi-node backends: each turns a `JobPlan` into the processes the runner starts and supervises.

- ssh:     one OpenSSH client per node, in parallel, each running our per-node launcher (`launch.py`)
- pdsh:    one pdsh for all nodes, running the per-node launcher with `--node_rank=%n`
- openmpi, mpich, impi, slurm: `mpirun`/`srun` starts every rank; each rank runs
           `launch.py --rank_from_scheduler`, which sets our env contract and execs the user's script

Quoting: a remote command is one string that the remote login shell parses, so every piece goes through
`shlex.quote` (and pdsh additionally expands `%` sequences, so `%` is doubled). MPI and srun get argv
lists and environment blocks, never shell text. `SHARDSPEED_SSH_CONFIG` names an ssh config file used for
every ssh connection we or pdsh/mpirun/hydra make (`-F`); `SHARDSPEED_REMOTE_PYTHON` overrides the
interpreter started on other nodes (default: this one, `sys.executable`, which suits the usual shared
virtualenv or conda install).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from shardspeed.launcher import LauncherError, log
from shardspeed.launcher.hostfile import Resources, encode_world_info
from shardspeed.launcher.supervise import Worker

BACKENDS = ("ssh", "pdsh", "openmpi", "mpich", "impi", "slurm")
LAUNCH_MODULE = "shardspeed.launcher.launch"


@dataclass
class JobPlan:
    resources: Resources
    master_addr: str
    master_port: int
    script: str
    script_args: list[str]
    launch_flags: list[str] = field(default_factory=list)  # --module, --no_python, ... for launch.py
    exports: dict[str, str] = field(default_factory=dict)
    launcher_args: list[str] = field(default_factory=list)
    ssh_port: int | None = None
    ssh_config: str | None = None
    cwd: str = field(default_factory=os.getcwd)
    python: str = field(default_factory=lambda: os.environ.get("SHARDSPEED_REMOTE_PYTHON", sys.executable))

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.resources.values())

    def launch_argv(self, node_rank: str, *extra: str) -> list[str]:
        """`python -u -m shardspeed.launcher.launch ...` with the user's script and arguments untouched."""
        return [
            self.python,
            "-u",
            "-m",
            LAUNCH_MODULE,
            f"--world_info={encode_world_info(self.resources)}",
            f"--node_rank={node_rank}",
            f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
            *self.launch_flags,
            *extra,
            self.script,
            *self.script_args,
        ]


def ssh_options(plan: JobPlan) -> list[str]:
    options = ["-F", plan.ssh_config] if plan.ssh_config else []
    return options + (["-p", str(plan.ssh_port)] if plan.ssh_port else [])


def remote_command(plan: JobPlan, node_rank: str) -> str:
    """Shell text for the remote login shell: cd, set the exported variables, exec the per-node launcher."""
    env = [shlex.quote(f"{k}={v}") for k, v in plan.exports.items()]
    argv = [shlex.quote(a) for a in plan.launch_argv(node_rank, "--stop_on_stdin_eof")]
    return " ".join(["cd", shlex.quote(plan.cwd), "&&", "exec", "env", *env, *argv])


def ssh_workers(plan: JobPlan) -> list[Worker]:
    base = ["ssh", "-o", "BatchMode=yes", *ssh_options(plan), *plan.launcher_args]
    return [
        Worker(name=f"node {host}", argv=[*base, host, remote_command(plan, str(i))], stdin_pipe=True)
        for i, host in enumerate(plan.resources)
    ]


def pdsh_workers(plan: JobPlan) -> list[Worker]:
    env = dict(os.environ, PDSH_RCMD_TYPE="ssh")
    # pdsh splits this variable on whitespace, so a config path must not contain spaces.
    extra = " ".join(ssh_options(plan))
    if extra:
        env["PDSH_SSH_ARGS_APPEND"] = (env.get("PDSH_SSH_ARGS_APPEND", "") + " " + extra).strip()
    command = remote_command(plan, "%n").replace("%", "%%").replace("--node_rank=%%n", "--node_rank=%n")
    argv = ["pdsh", "-S", "-f", "1024", "-w", ",".join(plan.resources), *plan.launcher_args, command]
    # pdsh waits for every node; this line (printed as soon as one node fails) lets us stop the rest.
    failed = re.compile(rb"^pdsh@\S+: \S+: ssh exited with exit code (?P<code>\d+)")
    return [Worker(name="pdsh", argv=argv, env=env, failure_line=failed)]


def _uniform_slots(plan: JobPlan, backend: str) -> int:
    counts = {len(s) for s in plan.resources.values()}
    if len(counts) != 1:
        per_host = ", ".join(f"{h}={len(s)}" for h, s in plan.resources.items())
        raise LauncherError(f"--launcher {backend} needs the same number of slots on every host ({per_host})")
    return counts.pop()


def _shim(plan: JobPlan) -> list[str]:
    return plan.launch_argv("0", "--rank_from_scheduler")


def openmpi_workers(plan: JobPlan) -> list[Worker]:
    hosts = ",".join(f"{h}:{len(s)}" for h, s in plan.resources.items())
    argv = ["mpirun", "-n", str(plan.world_size), "--host", hosts, "--map-by", "slot"]
    # OpenMPI binds each rank to one core by default, which starves torch's intra-op threads.
    if not any(a.startswith("--bind-to") for a in plan.launcher_args):
        argv += ["--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")  # containers run as root; OpenMPI refuses without this
    rsh = " ".join(shlex.quote(a) for a in ssh_options(plan))
    if rsh and "plm_rsh_args" not in plan.launcher_args:
        argv += ["--mca", "plm_rsh_args", rsh]
    argv += plan.launcher_args
    for name, value in plan.exports.items():
        argv += ["-x", f"{name}={value}"]
    return [Worker(name="mpirun", argv=argv + _shim(plan))]


def _hydra_argv(plan: JobPlan, backend: str, program: str) -> list[str]:
    per_node = _uniform_slots(plan, backend)
    argv = [program, "-n", str(plan.world_size), "-ppn", str(per_node), "-hosts", ",".join(plan.resources)]
    rsh = " ".join(shlex.quote(a) for a in ssh_options(plan))
    if rsh:
        argv += ["-bootstrap-exec-args", rsh]
    argv += plan.launcher_args
    for name, value in plan.exports.items():
        argv += ["-genv", name, value]
    if backend == "impi":
        argv += ["-genv", "I_MPI_PIN", "0"]  # the job's own binding, not Intel MPI's
    return argv + _shim(plan)


def mpich_workers(plan: JobPlan) -> list[Worker]:
    return [Worker(name="mpiexec", argv=_hydra_argv(plan, "mpich", hydra_program("mpich")))]


def impi_workers(plan: JobPlan) -> list[Worker]:
    return [Worker(name="mpirun", argv=_hydra_argv(plan, "impi", hydra_program("impi")))]


def slurm_workers(plan: JobPlan) -> list[Worker]:
    per_node = _uniform_slots(plan, "slurm")
    argv = ["srun", "-n", str(plan.world_size), "--nodes", str(len(plan.resources))]
    argv += ["--ntasks-per-node", str(per_node), "--distribution", "block", "-w", ",".join(plan.resources)]
    # Exports travel in srun's own environment (--export=ALL): `--export=K=V,...` breaks on commas.
    env = dict(os.environ, **plan.exports)
    return [Worker(name="srun", argv=[*argv, "--export=ALL", *plan.launcher_args, *_shim(plan)], env=env)]


WORKERS = {
    "ssh": ssh_workers,
    "pdsh": pdsh_workers,
    "openmpi": openmpi_workers,
    "mpich": mpich_workers,
    "impi": impi_workers,
    "slurm": slurm_workers,
}


def _mpirun_flavour(program: str) -> str:
    try:
        out = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "Intel(R) MPI" in text:
        return "impi"
    return "mpich" if "HYDRA" in text else ""


def hydra_program(backend: str) -> str:
    """The hydra launcher for MPICH or Intel MPI; Debian installs MPICH's as mpiexec.hydra/mpirun.mpich."""
    candidates = ["mpirun", "mpiexec", "mpiexec.hydra", "mpirun.mpich"]
    for name in candidates:
        if shutil.which(name) and _mpirun_flavour(name) == backend:
            return name
    raise LauncherError(f"launcher {backend!r} not installed: none of {', '.join(candidates)} is its mpirun")


def hydra_argv(plan: JobPlan, backend: str) -> list[str]:
    """The MPICH or Intel MPI command for `plan`, for showing or running elsewhere: the hydra program installed
    here, or `mpirun` (the name both install theirs under) when none is."""
    try:
        program = hydra_program(backend)
    except LauncherError:
        program = "mpirun"
    return _hydra_argv(plan, backend, program)


def check_installed(backend: str) -> None:
    """Raise a clear error if the tools a backend needs are missing (before anything starts)."""
    needed = {"ssh": ["ssh"], "pdsh": ["pdsh", "ssh"], "openmpi": ["mpirun", "ompi_info"], "slurm": ["srun"]}
    missing = [tool for tool in needed.get(backend, []) if shutil.which(tool) is None]
    if missing:
        raise LauncherError(f"launcher {backend!r} not installed: {', '.join(missing)} not found on PATH")
    if backend == "openmpi" and _mpirun_flavour("mpirun") != "openmpi":
        raise LauncherError("launcher 'openmpi': the mpirun on PATH is not Open MPI's")
    if backend in ("mpich", "impi"):
        hydra_program(backend)


def probe_hosts(hosts: list[str], plan: JobPlan, timeout: int = 5) -> None:
    """Check every host takes a passwordless ssh login, in parallel; name every host that does not."""
    base = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", *ssh_options(plan)]
    probes = {
        h: subprocess.Popen(
            [*base, h, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        for h in hosts
    }
    failures = []
    for host, proc in probes.items():
        try:
            _, err = proc.communicate(timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            failures.append(f"{host} ({lines[-1] if lines else f'ssh exit code {proc.returncode}'})")
    if failures:
        raise LauncherError(
            "not reachable by passwordless ssh: " + "; ".join(failures) + ". Fix ssh (keys, ~/.ssh/config or "
            "SHARDSPEED_SSH_CONFIG, --ssh_port), or pass --no_ssh_check to skip this check."
        )


def _resolve(name: str) -> str | None:
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None


def ssh_hostname(host: str, plan: JobPlan) -> str:
    """The address ssh actually connects to for `host` (after ~/.ssh/config or SHARDSPEED_SSH_CONFIG aliases)."""
    try:
        out = subprocess.run(
            ["ssh", "-G", *ssh_options(plan), host], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in out.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname":
            return value.strip()
    return host


def infer_master_addr(plan: JobPlan, use_ssh: bool = True) -> str:
    """Address of the first host that every node can reach, used as MASTER_ADDR.

    The first host's name (through the ssh config) resolved here; if that is a loopback address while the
    job spans several real machines, ask the host itself (`hostname -I`, as DeepSpeed does).
    """
    hosts = list(plan.resources)
    first = ssh_hostname(hosts[0], plan) if use_ssh else hosts[0]
    address = _resolve(first)
    all_local = all(
        (_resolve(ssh_hostname(h, plan) if use_ssh else h) or "").startswith("127.") for h in hosts
    )
    if address and (not address.startswith("127.") or all_local):
        log.info(f"master address {address} (first host {hosts[0]!r}); set --master_addr to override")
        return address
    if use_ssh:
        command = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
            *ssh_options(plan),
            hosts[0],
            "hostname -I",
        ]
        try:
            out = subprocess.run(
                command, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL
            )
            if out.returncode == 0 and out.stdout.split():
                log.info(f"master address {out.stdout.split()[0]} (from `hostname -I` on {hosts[0]!r})")
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    if address:
        return address
    raise LauncherError(f"cannot find an address for the first host {hosts[0]!r}; pass --master_addr")
