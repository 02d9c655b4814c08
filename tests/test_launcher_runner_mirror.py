"""DeepSpeed's `MultiNodeRunner` base class through the import table: a subclass builds its exports with
DeepSpeed's quoting, and the concrete runners stay refused by name."""

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


def test_base_is_abstract_and_concrete_runners_are_refused():
    from shardspeed.launcher.multinode_runner import MultiNodeRunner, PDSHRunner

    with pytest.raises(TypeError, match="abstract"):
        MultiNodeRunner(SimpleNamespace(user_script="x.py", user_args=[]), "")
    with pytest.raises(NotOfferedError, match="PDSHRunner"):
        PDSHRunner(SimpleNamespace(user_script="x.py", user_args=[]), "")
