"""DeepSpeed's concrete runners in `deepspeed.launcher.multinode_runner` (PDSHRunner, OpenMPIRunner,
MPICHRunner, IMPIRunner, SlurmRunner), each building shardspeed's own command for that backend.

A runner is built from the launcher's parsed arguments and the encoded host -> slots map, and `get_cmd`
returns the command that starts the job on the hosts, as DeepSpeed's do; the command is the one
`shardspeed --launcher <backend>` runs (shardspeed/launcher/multinode.py): the backend starts shardspeed's
per-node launcher (pdsh) or one shim per rank (mpirun, srun), which sets the same environment contract, on
the hosts and slots of `get_cmd`'s `active_resources`.
Where DeepSpeed's command differs, ours is kept and the difference is documented (docs/compatibility.md):
OpenMPI gets no hard-coded `--mca btl_tcp_if_include eth0` (hosts name their NICs otherwise) and no
`UCX_TLS=tcp`, and the `--include`/`--exclude` filters work with it. MVAPICHRunner stays refused by name
(no MVAPICH backend: its hydra runs with `--launcher mpich`).
"""

from __future__ import annotations

import os
import shlex

from shardspeed.compat.mirrors.launcher_runner import MultiNodeRunner
from shardspeed.launcher import LauncherError, multinode
from shardspeed.launcher.hostfile import encode_world_info
from shardspeed.launcher.runner import launch_flags
from shardspeed.launcher.supervise import Worker

__all__ = ["IMPIRunner", "MPICHRunner", "OpenMPIRunner", "PDSHRunner", "SlurmRunner"]


def _slots(active_resources) -> dict[str, list[int]]:
    """The hosts to run on as {host: [slot, ...]}; DeepSpeed passes slot lists or, in places, slot counts."""
    return {
        str(host): list(range(slots)) if isinstance(slots, int) else [int(slot) for slot in slots]
        for host, slots in active_resources.items()
    }


class _BackendRunner(MultiNodeRunner):
    """A DeepSpeed runner class over one of shardspeed's backends (`backend`)."""

    backend = ""

    def __init__(self, args, world_info_base64, resource_pool=None):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    @property
    def name(self) -> str:
        return self.backend

    def backend_exists(self) -> bool:
        try:
            multinode.check_installed(self.backend)
        except LauncherError:
            return False
        return True

    def _plan(self, active_resources) -> multinode.JobPlan:
        launcher_args = self.args.launcher_args
        if isinstance(launcher_args, str):  # parse_args leaves it one string; the launcher splits it later
            launcher_args = shlex.split(launcher_args)
        return multinode.JobPlan(
            resources=_slots(active_resources),
            master_addr=self.args.master_addr,
            master_port=self.args.master_port,
            script=self.user_script,
            script_args=list(self.user_arguments),
            launch_flags=launch_flags(self.args),
            exports=self._raw_exports(),
            launcher_args=launcher_args,
            ssh_port=self.args.ssh_port,
            ssh_config=os.environ.get("SHARDSPEED_SSH_CONFIG") or None,
        )

    def _raw_exports(self) -> dict[str, str]:
        """`exports` without the shell quotes `add_export` puts around some values: our backends quote for the
        remote shell themselves, and pass argv and environment blocks unquoted."""
        return {k: v[1:-1] if len(v) > 1 and v[0] == v[-1] == '"' else v for k, v in self.exports.items()}

    def _worker(self, active_resources) -> Worker:
        (worker,) = multinode.WORKERS[self.backend](self._plan(active_resources))
        return worker

    def get_cmd(self, environment, active_resources):
        return self._worker(active_resources).argv


class PDSHRunner(_BackendRunner):
    """pdsh over ssh; `get_cmd` returns (command, the command that kills the job's launchers, environment)."""

    backend = "pdsh"

    def __init__(self, args, world_info_base64):
        super().__init__(args, world_info_base64)

    def get_cmd(self, environment, active_resources):
        worker = self._worker(active_resources)
        pdsh_variables = {k: v for k, v in (worker.env or {}).items() if k.startswith("PDSH_")}
        environment.update(pdsh_variables)  # PDSH_RCMD_TYPE=ssh, ssh options: pdsh reads them from its env
        # The command before the remote one (pdsh and its flags); the pattern names this job's world info.
        prefix = worker.argv[:-1]
        pattern = f"{multinode.LAUNCH_MODULE} --world_info={encode_world_info(_slots(active_resources))}"
        kill_command = [*prefix, f"pkill -f {shlex.quote(pattern)}"]
        return worker.argv, kill_command, environment


class OpenMPIRunner(_BackendRunner):
    """Open MPI's mpirun starting one rank shim per slot."""

    backend = "openmpi"


class MPICHRunner(_BackendRunner):
    """MPICH's hydra (mpirun/mpiexec) starting one rank shim per slot."""

    backend = "mpich"

    def _worker(self, active_resources) -> Worker:
        return Worker(self.backend, multinode.hydra_argv(self._plan(active_resources), self.backend))


class IMPIRunner(MPICHRunner):
    """Intel MPI's hydra (mpirun) starting one rank shim per slot."""

    backend = "impi"


class SlurmRunner(_BackendRunner):
    """srun; the exports travel in srun's own environment, so `get_cmd` adds them to `environment`, the
    environment the command is to be started with (a comma in a value would break `--export=K=V,...`)."""

    backend = "slurm"

    def get_cmd(self, environment, active_resources):
        environment.update(self._raw_exports())
        return self._worker(active_resources).argv
