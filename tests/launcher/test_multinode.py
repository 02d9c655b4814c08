"""Multi-node backends: argv/quoting units for all of them, real 2-node x 2-rank runs over a loopback sshd.

The real runs train the same tiny model as a single-node 4-rank run and must end with identical
parameters. Nodes are host aliases for 127.0.0.2 and 127.0.0.3 (see sshd.py); Gloo is kept on `lo`
(GLOO_SOCKET_IFNAME) and MPI on `lo` (btl/oob_tcp_if_include), so nothing leaves 127.0.0.0/8.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from shardspeed.launcher import LauncherError, multinode
from shardspeed.launcher.hostfile import decode_world_info

from .helpers import (
    PROBE,
    REPO,
    TRAIN,
    alive,
    launcher_env,
    read_ranks,
    run_cli,
    wait_until,
    write_hostfile,
)

TRICKY = "a b; touch /tmp/shardspeed-pwned-mn $(id) `id` \"dq\" 'sq' %n %h 100%"
RESOURCES = {"node1": [0, 1], "node2": [0, 1]}


def plan(**overrides) -> multinode.JobPlan:
    values = dict(
        resources=RESOURCES,
        master_addr="127.0.0.2",
        master_port=29555,
        script="train.py",
        script_args=[TRICKY, "--x=1"],
        launch_flags=["--no_local_rank"],
        exports={"NCCL_DEBUG": "INFO", "WEIRD": "v; $(id) 'q'"},
        ssh_config="/tmp/cfg",
        ssh_port=2222,
        cwd="/work dir",
        python="/usr/bin/python3",
    )
    values.update(overrides)
    return multinode.JobPlan(**values)


# ---- argv builders (no tools needed) ------------------------------------------------------------------


def test_ssh_remote_command_parses_back_to_the_exact_argv():
    workers = multinode.ssh_workers(plan())
    assert [w.name for w in workers] == ["node node1", "node node2"]
    argv = workers[1].argv
    assert argv[:7] == ["ssh", "-o", "BatchMode=yes", "-F", "/tmp/cfg", "-p", "2222"] and argv[7] == "node2"
    assert workers[1].stdin_pipe  # closing it stops the remote launcher
    words = shlex.split(argv[8])  # what the remote login shell will see
    assert words[:4] == ["cd", "/work dir", "&&", "exec"]
    assert words[4:7] == ["env", "NCCL_DEBUG=INFO", "WEIRD=v; $(id) 'q'"]
    assert words[7:11] == ["/usr/bin/python3", "-u", "-m", "shardspeed.launcher.launch"]
    assert "--node_rank=1" in words and "--stop_on_stdin_eof" in words and "--no_local_rank" in words
    assert words[-3:] == ["train.py", TRICKY, "--x=1"]
    world_info = next(w for w in words if w.startswith("--world_info="))
    assert decode_world_info(world_info.split("=", 1)[1]) == RESOURCES


def test_pdsh_escapes_percent_and_keeps_node_rank_placeholder():
    (worker,) = multinode.pdsh_workers(plan())
    assert worker.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node1,node2"]
    assert (
        worker.env["PDSH_RCMD_TYPE"] == "ssh" and "-F /tmp/cfg -p 2222" in worker.env["PDSH_SSH_ARGS_APPEND"]
    )
    command = worker.argv[-1]
    assert "--node_rank=%n" in command and "%%n %%h 100%%" in command
    unescaped = command.replace("--node_rank=%n", "--node_rank=0").replace("%%", "%")
    assert shlex.split(unescaped)[-3:] == ["train.py", TRICKY, "--x=1"]
    assert worker.failure_line.search(b"pdsh@box: node2: ssh exited with exit code 5")["code"] == b"5"


def test_openmpi_argv():
    (worker,) = multinode.openmpi_workers(plan(resources={"node1": [0, 1], "node2": [0]}))
    argv = worker.argv
    assert argv[:7] == ["mpirun", "-n", "3", "--host", "node1:2,node2:1", "--map-by", "slot"]
    assert argv[7:9] == ["--bind-to", "none"]
    assert argv[argv.index("plm_rsh_args") + 1] == "-F /tmp/cfg -p 2222"
    assert "WEIRD=v; $(id) 'q'" in argv and argv[argv.index("WEIRD=v; $(id) 'q'") - 1] == "-x"
    assert "--rank_from_scheduler" in argv and argv[-3:] == ["train.py", TRICKY, "--x=1"]


def test_hydra_and_slurm_argv(monkeypatch):
    monkeypatch.setattr(multinode, "hydra_program", lambda backend: "mpiexec.hydra")
    (mpich,) = multinode.mpich_workers(plan())
    assert mpich.argv[:7] == ["mpiexec.hydra", "-n", "4", "-ppn", "2", "-hosts", "node1,node2"]
    assert mpich.argv[mpich.argv.index("WEIRD") + 1] == "v; $(id) 'q'"
    (impi,) = multinode.impi_workers(plan())
    assert impi.argv[impi.argv.index("I_MPI_PIN") + 1] == "0"
    (srun,) = multinode.slurm_workers(plan())
    assert srun.argv[:9] == [
        "srun",
        "-n",
        "4",
        "--nodes",
        "2",
        "--ntasks-per-node",
        "2",
        "--distribution",
        "block",
    ]
    assert srun.env["WEIRD"] == "v; $(id) 'q'" and "--export=ALL" in srun.argv  # values not in argv
    with pytest.raises(LauncherError, match="same number of slots on every host"):
        multinode.slurm_workers(plan(resources={"node1": [0, 1], "node2": [0]}))


def test_rank_from_scheduler_maps_mpi_env(tmp_path):
    # What an OpenMPI rank sees, turned into our env contract by `launch --rank_from_scheduler`.
    argv = [sys.executable, "-m", "shardspeed.launcher.launch", "--rank_from_scheduler"]
    argv += [
        f"--world_info={multinode.encode_world_info(RESOURCES)}",
        "--master_addr=127.0.0.2",
        PROBE,
        "q r",
    ]
    env = launcher_env(
        SHARDSPEED_TEST_OUT=str(tmp_path),
        OMPI_COMM_WORLD_RANK="3",
        OMPI_COMM_WORLD_SIZE="4",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
    )
    subprocess.run(argv, env=env, check=True, timeout=60)
    seen = read_ranks(tmp_path)[3]
    assert seen["argv"] == ["--local_rank=1", "q r"]
    want = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "CROSS_RANK": "1", "LOCAL_SIZE": "2"}
    assert {k: seen["env"][k] for k in want} == want and seen["env"]["MASTER_ADDR"] == "127.0.0.2"


# ---- real runs over the loopback sshd ------------------------------------------------------------------

HOSTFILE = "node1 slots=2\nnode2 slots=2\n"


def multinode_env(server, **extra) -> dict[str, str]:
    values = {"SHARDSPEED_SSH_CONFIG": server.config, "OMPI_ALLOW_RUN_AS_ROOT": "1"}
    values["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return launcher_env(**{**values, **extra})


@pytest.fixture(scope="module")
def single_node_result(tmp_path_factory):
    """The reference: the same job as one node with 4 ranks."""
    out = tmp_path_factory.mktemp("reference") / "result.json"
    result = run_cli(["--num_gpus", "4", "--master_port", "29561", TRAIN, "--out", str(out)])
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def _train_over(launcher, server, tmp_path, single_node_result, extra_args=(), port=29562):
    if launcher == "pdsh" and not shutil.which("pdsh"):
        pytest.skip("pdsh not installed (apt-get install pdsh; see .ci/setup-launchers.sh)")
    if launcher == "openmpi" and not (shutil.which("mpirun") and shutil.which("ompi_info")):
        pytest.skip("Open MPI not installed (apt-get install openmpi-bin; see .ci/setup-launchers.sh)")
    out = tmp_path / "result.json"
    marker = "/tmp/shardspeed-pwned-mn"
    args = ["-H", write_hostfile(tmp_path, HOSTFILE), "--launcher", launcher, "--master_port", str(port)]
    args += [*extra_args, TRAIN, "--out", str(out), "--extra", TRICKY]
    started = time.monotonic()
    result = run_cli(args, env=multinode_env(server), timeout=180)
    print(f"\n{launcher}: 2 nodes x 2 ranks trained in {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stdout + result.stderr
    got = json.loads(out.read_text())
    assert got["world_size"] == 4
    assert got["params"] == single_node_result["params"], "multi-node result differs from single-node"
    ranks = sorted(got["ranks"], key=lambda r: r["rank"])
    assert all(r["extra"] == TRICKY for r in ranks) and not os.path.exists(marker)
    assert [r["env"]["CROSS_RANK"] for r in ranks] == ["0", "0", "1", "1"]
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {"127.0.0.2"}  # inferred from node1, loopback
    return ranks


def test_ssh_two_nodes_match_single_node(loopback_sshd, tmp_path, single_node_result):
    ranks = _train_over("ssh", loopback_sshd, tmp_path, single_node_result)
    # Ranks 0-1 really came in through node1's address and 2-3 through node2's.
    assert [r["ssh_server"] for r in ranks] == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
    assert [r["local_rank_arg"] for r in ranks] == [0, 1, 0, 1]


def test_pdsh_two_nodes_match_single_node(loopback_sshd, tmp_path, single_node_result):
    ranks = _train_over("pdsh", loopback_sshd, tmp_path, single_node_result, port=29563)
    assert [r["ssh_server"] for r in ranks] == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]


def test_openmpi_two_nodes_match_single_node(loopback_sshd, tmp_path, single_node_result):
    mca = "--mca btl self,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"
    ranks = _train_over(
        "openmpi", loopback_sshd, tmp_path, single_node_result, ["--launcher_args", mca], 29564
    )
    assert [r["local_rank_arg"] for r in ranks] == [0, 1, 0, 1]


def test_env_and_quoting_reach_remote_ranks(loopback_sshd, tmp_path, probe_out):
    work = tmp_path / "work"
    work.mkdir()
    (work / ".deepspeed_env").write_text("# comment\nFROM_ENV_FILE=x y $(id)\n")
    env = multinode_env(
        loopback_sshd,
        SHARDSPEED_TEST_OUT=str(probe_out),
        SHARDSPEED_TEST_VALUE=TRICKY,
        NCCL_TEST_VAR="n c",
        NOT_EXPORTED_VAR="1",
    )
    args = [
        "-H",
        write_hostfile(tmp_path, HOSTFILE),
        "--master_port",
        "29565",
        "--no_local_rank",
        PROBE,
        TRICKY,
    ]
    result = run_cli(args, env=env, cwd=str(work))
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    assert sorted(ranks) == [0, 1, 2, 3]
    for seen in ranks.values():
        assert seen["argv"] == [TRICKY]
        assert seen["env"]["SHARDSPEED_TEST_VALUE"] == TRICKY and seen["env"]["NCCL_TEST_VAR"] == "n c"
        assert seen["env"]["FROM_ENV_FILE"] == "x y $(id)" and seen["env"]["NOT_EXPORTED_VAR"] is None
        assert seen["cwd"] == str(work) and seen["env"]["PYTHONPATH"].split(":")[0] == str(work)
        assert seen["env"]["SSH_CONNECTION"] is not None  # it really ran through sshd


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_remote_failure_stops_every_node(loopback_sshd, tmp_path, probe_out, launcher):
    if launcher == "pdsh" and not shutil.which("pdsh"):
        pytest.skip("pdsh not installed (apt-get install pdsh; see .ci/setup-launchers.sh)")
    env = multinode_env(
        loopback_sshd,
        SHARDSPEED_TEST_OUT=str(probe_out),
        SHARDSPEED_TEST_FAIL_RANK="3",
        SHARDSPEED_TEST_FAIL_CODE="5",
        SHARDSPEED_TEST_FAIL_AFTER="1.5",
        SHARDSPEED_TEST_SLEEP="120",
    )
    args = ["-H", write_hostfile(tmp_path, HOSTFILE), "--launcher", launcher, "--master_port", "29566", PROBE]
    result = run_cli(args, env=env, timeout=90)
    elapsed = time.time() - float((probe_out / "failed_at").read_text())
    print(f"\n{launcher}: runner exited {elapsed:.2f} s after rank 3 on node2 failed")
    assert result.returncode == 5, result.stdout + result.stderr
    assert elapsed < 15
    assert "probe rank 3 failing now" in result.stdout + result.stderr
    pids = [seen["pid"] for seen in read_ranks(probe_out).values()]
    assert len(pids) == 4
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10), "ranks left on some node"


def test_sigterm_to_runner_stops_remote_ranks(loopback_sshd, tmp_path, probe_out):
    env = multinode_env(loopback_sshd, SHARDSPEED_TEST_OUT=str(probe_out), SHARDSPEED_TEST_SLEEP="120")
    args = ["-H", write_hostfile(tmp_path, HOSTFILE), "--master_port", "29567", PROBE]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardspeed.launcher.runner", *args],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert wait_until(lambda: len(read_ranks(probe_out)) == 4, timeout=60), "remote ranks did not start"
    pids = [seen["pid"] for seen in read_ranks(probe_out).values()]
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10), (
        "remote ranks outlived the runner"
    )


def test_unreachable_host_is_named_before_launch(loopback_sshd, tmp_path, probe_out):
    # node3 points at a loopback address where nothing listens: refused at once, no traffic leaves lo.
    config = tmp_path / "ssh_config"
    with open(loopback_sshd.config) as handle:
        text = handle.read()
    config.write_text(text.replace("Host *", "Host node3\n  HostName 127.0.0.4\n  Port 1\nHost *", 1))
    env = multinode_env(loopback_sshd, SHARDSPEED_TEST_OUT=str(probe_out), SHARDSPEED_SSH_CONFIG=str(config))
    result = run_cli(["-H", write_hostfile(tmp_path, "node1 slots=1\nnode3 slots=1\n"), PROBE], env=env)
    assert result.returncode == 2
    assert (
        "not reachable by passwordless ssh: node3 (" in result.stderr
        and "node1" not in result.stderr.split("ssh:")[1]
    )
    assert "Traceback" not in result.stderr and not list(probe_out.iterdir())
