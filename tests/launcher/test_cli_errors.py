"""Every bad input is one clear error line, a non-zero exit code, no traceback, and no rank started.

Most cases call `runner.main` in-process (importing shardspeed costs ~1.5 s per subprocess here, as the
package imports torch); a few run the real CLI to check the exit status and stderr end to end.
"""

import socket
import subprocess

import pytest

from shardspeed.launcher import runner

from .helpers import PROBE, launcher_env, needs_no_default_hostfile, run_cli, write_hostfile

TWO_HOSTS = "node1 slots=2\nnode2 slots=2\n"


def check_rejected(result, message: str, probe_out) -> None:
    print(result.stderr)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "shardspeed: error:" in result.stderr
    assert not list(probe_out.iterdir()), "a rank started although the input was rejected"


@pytest.mark.parametrize(
    ("hostfile", "flags", "message"),
    [
        ("node1 slots=2\nnode2 slotz=2\n", [], "line 2: 'node2 slotz=2' does not parse"),
        ("node1 slots=2\n# x\nnode1 slots=1\n", [], "line 3: 'node1 slots=1': host 'node1' is listed twice"),
        (TWO_HOSTS, ["--include", "node3"], "--include: host 'node3' is not in the hostfile"),
        (TWO_HOSTS, ["--exclude", "node1:5"], "--exclude: host 'node1' has no slot 5"),
        (
            TWO_HOSTS,
            ["--include", "node1", "--exclude", "node2"],
            "--include and --exclude cannot be used together",
        ),
        (TWO_HOSTS, ["--num_gpus", "1", "--include", "node1"], "cannot be combined with --include/--exclude"),
        (TWO_HOSTS, ["--num_nodes", "3"], "--num_nodes 3 but only 2 host(s)"),
        (TWO_HOSTS, ["--no_python", "--module"], "--module and --no_python cannot be used together"),
        (TWO_HOSTS, ["--node_rank", "1"], "--node_rank is only used with --no_ssh"),
        (TWO_HOSTS, ["--no_ssh"], "--no_ssh with 2 hosts needs --node_rank"),
        (TWO_HOSTS, ["--no_ssh", "--node_rank", "2"], "--node_rank 2 is outside 0..1"),
        (TWO_HOSTS, ["--no_ssh", "--force_multi"], "--no_ssh and --force_multi cannot be used together"),
        (TWO_HOSTS, ["--launcher", "foo"], "unknown --launcher 'foo'"),
        (TWO_HOSTS, ["--launcher", "MVAPICH"], "--launcher mvapich is not supported"),
        (TWO_HOSTS, ["--launcher", "slurm"], "launcher 'slurm' not installed: srun not found"),
        (TWO_HOSTS, ["--launcher_args", "-o 'unbalanced"], "--launcher_args"),
        (TWO_HOSTS, ["--elastic_training"], "elastic training"),
        (TWO_HOSTS, ["--autotuning", "tune"], "--autotuning tune: --autotuning needs the script's config"),
        (TWO_HOSTS, ["--num_gpus", "0"], "--num_gpus must be a positive number"),
        (TWO_HOSTS, ["--master_port", "70000"], "--master_port must be between 1 and 65535"),
    ],
)
def test_bad_input_is_rejected_before_start(
    tmp_path, probe_out, monkeypatch, capsys, hostfile, flags, message
):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no srun on this PATH
    code = runner.main(["-H", write_hostfile(tmp_path, hostfile), *flags, PROBE])
    result = subprocess.CompletedProcess([], code, *capsys.readouterr())
    check_rejected(result, message, probe_out)


def test_cli_error_end_to_end(tmp_path, probe_out):
    hostfile = write_hostfile(tmp_path, "node1 slots=2\nnode1 slots=2\n")
    result = run_cli(["-H", hostfile, PROBE], env=launcher_env(SHARDSPEED_TEST_OUT=str(probe_out)))
    check_rejected(result, "line 2: 'node1 slots=2': host 'node1' is listed twice", probe_out)
    assert result.returncode == 2


def in_process(args, capsys) -> subprocess.CompletedProcess:
    code = runner.main(args)
    return subprocess.CompletedProcess(args, code, *capsys.readouterr())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num_gpus", "1", "/nonexistent/train.py"], "training script '/nonexistent/train.py' not found"),
        (["--num_gpus", "1", "--no_python", PROBE], "is not an executable file"),
        (["--num_gpus", "1", "--no_python", "no-such-command-xyz"], "not a file here nor a command on PATH"),
        (["-H", "/nonexistent/hostfile", PROBE], "cannot read hostfile /nonexistent/hostfile"),
        (["--num_gpus", "1", "--bind_core_list", "4096", PROBE], "cores [4096] are not available here"),
        (["--num_gpus", "9999", "--bind_cores_to_rank", PROBE], "cannot be split among 9999 ranks"),
    ],
)
def test_bad_script_hostfile_and_binding(probe_out, monkeypatch, capsys, flags, message):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    check_rejected(in_process(flags, capsys), message, probe_out)


def test_kmp_affinity_conflicts_with_binding(probe_out, monkeypatch, capsys):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    result = in_process(["--num_gpus", "1", "--bind_cores_to_rank", PROBE], capsys)
    check_rejected(result, "conflicts with KMP_AFFINITY", probe_out)


@needs_no_default_hostfile
def test_num_nodes_without_hostfile(probe_out, monkeypatch, capsys):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    check_rejected(
        in_process(["--num_nodes", "2", PROBE], capsys), "--num_nodes 2 needs a hostfile", probe_out
    )


def test_master_port_in_use(probe_out, monkeypatch, capsys):
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = in_process(["--num_gpus", "1", "--master_port", str(port), PROBE], capsys)
    check_rejected(result, f"--master_port {port} is already in use", probe_out)


def test_bad_env_file_line(tmp_path, probe_out, monkeypatch, capsys):
    (tmp_path / ".shardspeed_env").write_text("GOOD=1\nthis is wrong\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDSPEED_TEST_OUT", str(probe_out))
    result = in_process(["--num_gpus", "1", PROBE], capsys)
    check_rejected(result, "line 2: 'this is wrong' is not NAME=value", probe_out)


@pytest.mark.parametrize(
    "flags", [["--num_nodes", "1", "-i", "localhost"], ["--num_gpus", "1", "-e", "localhost"]]
)
def test_deepspeed_programmatic_main_raises_value_error_naming_the_problem(flags, tmp_path):
    """DeepSpeed's `runner.main(args=[...])` raises ValueError on a bad command line (its tests call it so);
    the console-script form prints the same message and exits 2 instead."""
    with pytest.raises(ValueError, match="cannot be combined with --include/--exclude"):
        runner.main(args=[*flags, str(tmp_path / "train.py")])
    with pytest.raises(TypeError, match="not both"):
        runner.main(["x.py"], args=["x.py"])
