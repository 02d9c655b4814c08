"""DeepSpeed's `deepspeed.launcher.multinode_runner` through the import table: a subclass of `MultiNodeRunner`
builds its exports with DeepSpeed's quoting, the concrete runners build shardspeed's backends' commands, and
MVAPICHRunner stays refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import shardspeed as deepspeed  # noqa: F401  (installs the import table for `deepspeed.*` paths)
from shardspeed.compat.not_offered import NotOfferedError


def _runner_class():
    from shardspeed.launcher.multinode_runner import MultiNodeRunner

    class ListRunner(MultiNodeRunner):
        def backend_exists(self):
            return True

        def get_cmd(self, environment, active_resources):
            exports = [f"{k}={v}" for k, v in self.exports.items()]
            return ["env", *exports, "python", self.user_script, *self.user_arguments]

    return ListRunner


def test_subclass_builds_its_command_with_quoted_exports():
    args = SimpleNamespace(user_script="train.py", user_args=["--lr", "0.1"])
    runner = _runner_class()(args, "e30=")
    runner.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
    runner.add_export(" PYTHONPATH ", " /usr/lib/python3/site-packages ")
    runner.add_export("NAME", "a b")
    assert runner.exports == {
        "SLURM_JOB_CPUS_PER_NODE": '"64(x2)"',
        "PYTHONPATH": "/usr/lib/python3/site-packages",
        "NAME": '"a b"',
    }
    assert runner.name == "ListRunner" and runner.world_info_base64 == "e30="
    assert runner.get_cmd({}, {})[-3:] == ["train.py", "--lr", "0.1"]


def test_base_is_abstract_and_mvapich_is_refused():
    from shardspeed.launcher.multinode_runner import MultiNodeRunner, MVAPICHRunner

    with pytest.raises(TypeError, match="abstract"):
        MultiNodeRunner(SimpleNamespace(user_script="x.py", user_args=[]), "")
    with pytest.raises(NotOfferedError, match="MVAPICHRunner"):
        MVAPICHRunner(SimpleNamespace(user_script="x.py", user_args=[]), "", {})


def _args(*flags):
    from shardspeed.launcher.runner import parse_args

    return parse_args([*flags, "train.py", "--lr", "1"])


HOSTS = {"worker-0": 2, "worker-1": 2}
SLOTS = {"worker-0": [0, 1], "worker-1": [0, 1]}


def _plan(**changes):
    from shardspeed.launcher.multinode import JobPlan

    plan = dict(
        resources=SLOTS,
        master_addr="10.0.0.1",
        master_port=29500,
        script="train.py",
        script_args=["--lr", "1"],
    )
    plan.update(changes)
    return JobPlan(**plan)


def test_concrete_runners_build_our_backends_commands():
    """Each DeepSpeed runner class returns the command shardspeed's launcher builds for that backend."""
    from shardspeed.launcher import multinode
    from shardspeed.launcher.hostfile import encode_world_info
    from shardspeed.launcher.multinode_runner import MPICHRunner, OpenMPIRunner, PDSHRunner, SlurmRunner

    args = _args("--master_addr", "10.0.0.1", "--launcher_args", "--mca btl_tcp_if_include eth1")
    world_info = encode_world_info(HOSTS)
    runners = {
        "openmpi": OpenMPIRunner(args, world_info, HOSTS),
        "slurm": SlurmRunner(args, world_info, HOSTS),
    }
    for backend, runner in runners.items():
        runner.add_export("NAME", "a b")  # quoted for a shell by add_export; our backends take it raw
        environment = {}
        expected = multinode.WORKERS[backend](
            _plan(launcher_args=["--mca", "btl_tcp_if_include", "eth1"], exports={"NAME": "a b"})
        )[0]
        assert runner.get_cmd(environment, HOSTS) == expected.argv and runner.name == backend
        assert environment == ({"NAME": "a b"} if backend == "slurm" else {})  # srun's exports ride its env
    mpich = MPICHRunner(args, world_info, HOSTS).get_cmd({}, HOSTS)
    assert mpich[1:6] == ["-n", "4", "-ppn", "2", "-hosts"] and mpich[-3:] == ["train.py", "--lr", "1"]

    pdsh = PDSHRunner(_args("--master_addr", "10.0.0.1"), world_info)
    environment = {"KEEP": "1"}
    command, kill_command, returned = pdsh.get_cmd(environment, SLOTS)
    assert command == multinode.pdsh_workers(_plan())[0].argv
    assert returned is environment and environment == {"KEEP": "1", "PDSH_RCMD_TYPE": "ssh"}
    assert kill_command[:-1] == command[:-1]
    assert (
        kill_command[-1] == f"pkill -f 'shardspeed.launcher.launch --world_info={encode_world_info(SLOTS)}'"
    )
    assert (
        f"--world_info={encode_world_info(SLOTS)}" in command[-1]
    )  # the pattern matches this job's launchers
