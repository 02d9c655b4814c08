"""Single-node launches: the env contract, every per-rank flag, quoting, env files, resource choice."""

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from .helpers import (
    PROBE,
    launcher_env,
    needs_no_default_hostfile,
    read_ranks,
    run_cli,
    write_hostfile,
)

INJECTION = "a b; touch /tmp/shardspeed-pwned-{} $(id) `id` \"q\" 'q' %n %h $HOME"


def test_env_contract_quoting_and_sessions(probe_out, tmp_path):
    marker = f"/tmp/shardspeed-pwned-{os.getpid()}"
    tricky = INJECTION.format(os.getpid())
    env = launcher_env(
        SHARDSPEED_TEST_OUT=str(probe_out), SHARDSPEED_TEST_LINES="2", SHARDSPEED_TEST_VALUE=tricky
    )
    result = run_cli(["--num_gpus", "3", "--master_port", "29517", PROBE, tricky, "--flag", ""], env=env)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    assert sorted(ranks) == [0, 1, 2]
    for rank, seen in ranks.items():
        assert seen["argv"] == [f"--local_rank={rank}", tricky, "--flag", ""]
        expected = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_SIZE": "3",
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29517",
            "CUDA_VISIBLE_DEVICES": "0,1,2",
        }
        assert {k: seen["env"][k] for k in expected} == expected
        assert seen["env"]["SHARDSPEED_TEST_VALUE"] == tricky
        assert seen["pid"] == seen["pgid"] == seen["sid"], "each rank must lead its own session"
        assert f"probe rank {rank} line 1" in result.stdout  # rank output is forwarded
    assert not os.path.exists(marker), "an argument was run by a shell"


def test_no_local_rank_and_core_binding(probe_out):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"needs 2 CPU cores to bind 2 ranks; this machine allows {len(cores)}")
    env = launcher_env(SHARDSPEED_TEST_OUT=str(probe_out))
    result = run_cli(["--num_gpus", "2", "--no_local_rank", "--bind_cores_to_rank", PROBE, "x"], env=env)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    per_rank = len(cores) // 2
    for rank, seen in ranks.items():
        assert seen["argv"] == ["x"]
        assert seen["affinity"] == cores[rank * per_rank : (rank + 1) * per_rank]
        assert seen["env"]["OMP_NUM_THREADS"] == str(per_rank)


def test_core_list_rank_logs_and_save_pid(probe_out, tmp_path):
    last_core = sorted(os.sched_getaffinity(0))[-1]
    logs = tmp_path / "logs"
    env = launcher_env(SHARDSPEED_TEST_OUT=str(probe_out), SHARDSPEED_TEST_LINES="3")
    args = [
        "--num_gpus",
        "1",
        "--bind_core_list",
        str(last_core),
        "--enable_each_rank_log",
        str(logs),
        "--save_pid",
    ]
    result = run_cli([*args, PROBE], env=env)
    assert result.returncode == 0, result.stderr
    seen = read_ranks(probe_out)[0]
    assert seen["affinity"] == [last_core] and seen["env"]["OMP_NUM_THREADS"] == "1"
    (log_file,) = logs.glob("*_rank0.log")
    assert "probe rank 0 line 2" in log_file.read_text()
    assert "probe rank 0 line" not in result.stdout  # with per-rank logs, output goes to the files only
    # --save_pid: the launcher wrote its pid to /tmp/<pid>.deepspeed while the job ran, and removed it.
    assert seen["saved_pid"] == str(seen["ppid"])
    assert not os.path.exists(f"/tmp/{seen['ppid']}.deepspeed")


def test_module_and_env_file(probe_out, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(PROBE, work / "probe_mod.py")
    (work / ".deepspeed_env").write_text("# from the env file\n\nFROM_ENV_FILE='one two'\n")
    env = launcher_env(SHARDSPEED_TEST_OUT=str(probe_out))
    result = run_cli(["--num_gpus", "2", "--module", "probe_mod", "m"], env=env, cwd=str(work))
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    assert [ranks[r]["argv"] for r in (0, 1)] == [["--local_rank=0", "m"], ["--local_rank=1", "m"]]
    assert ranks[0]["env"]["FROM_ENV_FILE"] == "one two"


def test_no_python_runs_an_executable(probe_out, tmp_path):
    script = tmp_path / "probe_exe"
    script.write_text(f"#!{sys.executable}\n" + Path(PROBE).read_text())
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    result = run_cli(
        ["--num_gpus", "1", "--no_python", str(script), "z"],
        env=launcher_env(SHARDSPEED_TEST_OUT=str(probe_out)),
    )
    assert result.returncode == 0, result.stderr
    assert read_ranks(probe_out)[0]["argv"] == ["--local_rank=0", "z"]


@needs_no_default_hostfile
def test_defaults_without_hostfile(probe_out):
    env = launcher_env(SHARDSPEED_TEST_OUT=str(probe_out))
    if any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")):
        pytest.skip("a GPU driver is present: the default is one process per GPU")
    result = run_cli([PROBE], env=env)
    assert result.returncode == 0, result.stderr
    assert "no GPU found and no --num_gpus: starting 1 CPU process" in result.stderr
    assert list(read_ranks(probe_out)) == [0]
    for stale in probe_out.iterdir():
        stale.unlink()
    # CUDA_VISIBLE_DEVICES without a hostfile selects those devices (one rank each), as DeepSpeed does.
    result = run_cli([PROBE], env={**env, "CUDA_VISIBLE_DEVICES": "1,3"})
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    assert [ranks[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["1,3", "1,3"]
    assert ranks[1]["env"]["WORLD_SIZE"] == "2"


def test_hostfile_include_and_no_ssh_node_rank(probe_out, tmp_path):
    env = launcher_env(SHARDSPEED_TEST_OUT=str(probe_out))
    hostfile = write_hostfile(tmp_path, "localhost slots=4\n")
    result = run_cli(["-H", hostfile, "--include", "localhost:1,3", PROBE], env=env)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    assert sorted(ranks) == [0, 1] and ranks[0]["env"]["CUDA_VISIBLE_DEVICES"] == "1,3"
    for stale in probe_out.iterdir():
        stale.unlink()
    # --no_ssh --node_rank: a scheduler starts one launcher per node; this one is node 1 of 2.
    hostfile = write_hostfile(tmp_path, "nodeA slots=2\nnodeB slots=2\n")
    args = ["-H", hostfile, "--no_ssh", "--node_rank", "1", "--master_addr", "127.0.0.1", PROBE]
    result = run_cli(args, env=env)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(probe_out)
    assert sorted(ranks) == [2, 3]
    assert [ranks[r]["env"]["LOCAL_RANK"] for r in (2, 3)] == ["0", "1"]
    assert {ranks[r]["env"]["CROSS_RANK"] for r in (2, 3)} == {"1"}
    assert ranks[2]["env"]["WORLD_SIZE"] == "4" and ranks[2]["env"]["CROSS_SIZE"] == "2"
