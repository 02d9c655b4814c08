"""More bad launcher input, each refused before any rank starts; awkward script arguments arrive verbatim.

Extends test_cli_errors.py (flag conflicts, backends, binding) and test_hostfile.py (the parser's own
units) with inputs a user or a generated hostfile can plausibly produce: shell syntax in host names,
negative or non-numeric counts, filters that select nothing, unreadable hostfiles.
"""

import os
import shlex
import subprocess

import pytest

from shardspeed.launcher import multinode, runner

from .helpers import PROBE, launcher_env, read_ranks, run_cli, write_hostfile
from .test_cli_errors import check_rejected

TWO_HOSTS = "node1 slots=2\nnode2 slots=2\n"
NOT_PLAIN = "may contain only letters, digits and '.', '_', ':', '-'"


@pytest.mark.parametrize(
    ("hostfile", "flags", "message"),
    [
        (
            "node1 slots=1\nnode;id slots=1\n",
            [],
            f"line 2: 'node;id slots=1': host name 'node;id' {NOT_PLAIN}",
        ),
        ("$(touch /tmp/x) slots=1\n", [], "does not parse"),  # a space: not even one word
        ("$(id) slots=1\n", [], f"line 1: '$(id) slots=1': host name '$(id)' {NOT_PLAIN}"),
        ("n`id` slots=1\n", [], f"host name 'n`id`' {NOT_PLAIN}"),
        ("a|b slots=1\n", [], f"host name 'a|b' {NOT_PLAIN}"),
        ("node1>x slots=1\n", [], f"host name 'node1>x' {NOT_PLAIN}"),
        ("\x00node slots=1\n", [], NOT_PLAIN),
        ("node1 slots=0\n", [], "line 1: 'node1 slots=0': slots must be a whole number >= 1, got '0'"),
        ("node1 slots=-1\n", [], "slots must be a whole number >= 1, got '-1'"),
        ("node1 slots=2.5\n", [], "slots must be a whole number >= 1, got '2.5'"),
        ("node1 slots=2 slots=3\n", [], "line 1: 'node1 slots=2 slots=3' does not parse"),
        ("node1 slots=2\nnode2\n", [], "line 2: 'node2' does not parse"),
        (
            "node1 slots=2\n\n# spare\nnode1 slots=2\n",
            [],
            "line 4: 'node1 slots=2': host 'node1' is listed twice",
        ),
        ("\n# only comments\n", [], "lists no hosts"),
        (TWO_HOSTS, ["--exclude", "node1@node2"], "the include/exclude filters leave no slots"),
        (TWO_HOSTS, ["--include", "node1:7"], "--include: host 'node1' has no slot 7"),
        (TWO_HOSTS, ["--include", "node1;id"], "--include: host 'node1;id' is not in the hostfile"),
        (TWO_HOSTS, ["--exclude", "node9"], "--exclude: host 'node9' is not in the hostfile"),
        (TWO_HOSTS, ["--num_nodes", "0"], "--num_nodes must be a positive number, got 0"),
        (TWO_HOSTS, ["--num_nodes", "-2"], "--num_nodes must be a positive number, got -2"),
        (TWO_HOSTS, ["--num_gpus", "-3"], "--num_gpus must be a positive number, got -3"),
        (TWO_HOSTS, ["--master_addr", "10.0.0.1;id"], f"--master_addr: host name '10.0.0.1;id' {NOT_PLAIN}"),
        (TWO_HOSTS, ["--master_port", "0"], "--master_port must be between 1 and 65535, got 0"),
        (TWO_HOSTS, ["--ssh_port", "65536"], "--ssh_port must be between 1 and 65535, got 65536"),
    ],
)
def test_bad_launcher_input_is_refused(tmp_path, probe_out, monkeypatch, capsys, hostfile, flags, message):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    code = runner.main(["-H", write_hostfile(tmp_path, hostfile), *flags, PROBE])
    check_rejected(subprocess.CompletedProcess([], code, *capsys.readouterr()), message, probe_out)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num_gpus", "two"], "argument --num_gpus/--num_accelerators: invalid int value: 'two'"),
        (["--num_nodes", "1.5"], "argument --num_nodes: invalid int value: '1.5'"),
        (["--master_port", "http"], "argument --master_port: invalid int value: 'http'"),
    ],
)
def test_non_numeric_counts_are_refused(probe_out, monkeypatch, capsys, flags, message):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    with pytest.raises(SystemExit) as exited:
        runner.main([*flags, PROBE])
    check_rejected(
        subprocess.CompletedProcess([], exited.value.code, *capsys.readouterr()), message, probe_out
    )


def test_unreadable_hostfiles_are_refused(tmp_path, probe_out, monkeypatch, capsys):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    binary = tmp_path / "binary"
    binary.write_bytes(b"node1 slots=1\n\xff\xfe\n")
    for path, message in ((tmp_path, "Is a directory"), (binary, "is not UTF-8 text")):
        code = runner.main(["-H", str(path), PROBE])
        check_rejected(subprocess.CompletedProcess([], code, *capsys.readouterr()), message, probe_out)


def test_script_that_is_a_directory_is_refused(tmp_path, probe_out, monkeypatch, capsys):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    code = runner.main(["--num_gpus", "1", str(tmp_path)])
    check_rejected(subprocess.CompletedProcess([], code, *capsys.readouterr()), "not found", probe_out)


# Arguments a shell would mangle, beyond test_single_node's INJECTION: a newline, a lone quote, a
# backslash, a glob, a redirection, a variable in braces, an option-looking word, non-ASCII, a long one.
AWKWARD = ["line1\nline2", "it's", "back\\slash", "*", "> /tmp/shardspeed-redirected", "${HOME}",
           "--", "-c", "ünïcødé ✓", "$(touch /tmp/shardspeed-pwned-awkward)", "x" * 5000]  # fmt: skip


def test_awkward_arguments_arrive_verbatim_in_every_rank(probe_out):
    marker = "/tmp/shardspeed-pwned-awkward"
    result = run_cli(
        ["--num_gpus", "2", PROBE, *AWKWARD], env=launcher_env(SHARDSPEED_TEST_OUT=str(probe_out))
    )
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    assert sorted(ranks) == [0, 1]
    for rank, seen in ranks.items():
        assert seen["argv"] == [f"--local_rank={rank}", *AWKWARD]
    assert not os.path.exists(marker) and not os.path.exists("/tmp/shardspeed-redirected")


def _plan() -> multinode.JobPlan:
    return multinode.JobPlan(resources={"node1": [0], "node2": [0]}, master_addr="127.0.0.2", master_port=29555,
                             script="train.py", script_args=AWKWARD, launch_flags=[], exports={},
                             ssh_config=None, ssh_port=None, cwd="/w", python="python3")  # fmt: skip


def test_awkward_arguments_survive_the_ssh_and_pdsh_commands():
    # The remote login shell parses the command once; it must give back exactly our words.
    for worker in multinode.ssh_workers(_plan()):
        assert shlex.split(worker.argv[-1])[-len(AWKWARD) - 1 :] == ["train.py", *AWKWARD]
    (worker,) = multinode.pdsh_workers(_plan())
    command = worker.argv[-1].replace("--node_rank=%n", "--node_rank=0").replace("%%", "%")
    assert shlex.split(command)[-len(AWKWARD) - 1 :] == ["train.py", *AWKWARD]
