"""The commands with DeepSpeed's names (shardspeed/tools/): `ds_bench`, `ds_io`, `ds_nvme_tune`, `ds_ssh`, plus
`deepspeed` and `ds_report` — their --help, a tiny real run each, and the flags they refuse by name. The
alias distribution installs them under DeepSpeed's names; its pyproject is checked to point at these.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import tomllib

from .helpers import REPO, launcher_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TOOLS = {
    "ds_bench": "shardspeed.tools.comm_bench",
    "ds_io": "shardspeed.tools.io_bench",
    "ds_nvme_tune": "shardspeed.tools.nvme_tune",
    "ds_ssh": "shardspeed.tools.ssh_all",
    "ds_report": "shardspeed.launcher.report",
    "deepspeed": "shardspeed.launcher.runner",
    "ds_to_universal": "shardspeed.checkpoint.to_universal",
}


def _run(module: str, *args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)  # fmt: skip


def test_the_alias_installs_deepspeeds_commands_and_shardspeed_its_own():
    alias = tomllib.loads((REPO / "integrations" / "deepspeed-alias" / "pyproject.toml").read_text())
    scripts = alias["project"]["scripts"]
    assert {name: target.split(":")[0] for name, target in scripts.items()} == TOOLS
    ours = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function))
        assert target in ours.values(), target  # the same implementation under shardspeed's own name


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_help(name):
    out = _run(TOOLS[name], "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_ds_bench_on_two_gloo_ranks():
    out = _run("shardspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()), "--module",
               "shardspeed.tools.comm_bench", "--scan", "--maxsize", "5", "--trials", "2", "--warmups", "1",
               env=launcher_env(), timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ds_bench: 2 ranks, backend gloo" in out.stdout
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "pt2pt"):
        rows = re.findall(rf"^(\d+)\s+{op}\s+([\d.]+) us\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.MULTILINE)
        assert [int(r[0]) for r in rows] == [8, 16, 32], (op, out.stdout)  # float32, multiples of 2 ranks
        assert all(float(r[1]) > 0 for r in rows)


def test_ds_bench_outside_a_launcher_starts_itself_through_one():
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    out = _run("shardspeed.tools.comm_bench", "--all-reduce", "--maxsize", "4", "--trials", "1", "--raw",
               env=env, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ds_bench: 1 ranks" in out.stdout and re.search(
        r"^16 [\d.]+ [\d.]+ [\d.]+$", out.stdout, re.MULTILINE
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--backend", "ccl"], "--backend ccl (oneCCL) is not offered"),
        (["--mem-factor", "0.5"], "--mem-factor sizes messages from GPU memory"),
        (["--dtype", "floaty"], "--dtype 'floaty' is not a torch dtype name"),
        (["--trials", "0"], "--trials must be at least 1, got 0"),
    ],
)
def test_ds_bench_refuses_by_name(flags, message):
    from shardspeed.tools import comm_bench

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        with pytest.raises(SystemExit, match=re.escape(message)):
            comm_bench.main([*flags, "--all-reduce"])  # refused before any process group exists


def test_ds_io_writes_reads_and_validates(tmp_path):
    for extra in ([], ["--read"]):
        out = _run("shardspeed.tools.io_bench", "--folder", str(tmp_path), "--io_size", "1M", "--block_size", "256K",
                   "--queue_depth", "4", "--io_parallel", "2", "--loops", "2", "--validate", *extra)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        kind = "Read" if extra else "Write"
        assert (
            re.search(rf"E2E {kind} Speed = [\d.]+ GB/sec", out.stdout) and "Validation: passed" in out.stdout
        )
    assert list(tmp_path.iterdir()) == []  # its files are removed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu"], "--gpu: GPU buffers are not offered"),
        (["--use_gds"], "--use_gds: GPUDirect Storage is not offered"),
        (["--engine", "torch_io"], "--engine 'torch_io': only aio_handle is offered"),
        (["--fast_io_size", "64M"], "--fast_io_size: the torch fast-I/O engine is not offered"),
        (["--io_size", "12Q"], "--io_size: expected a positive byte count like 4096, 1M or 2G, got '12Q'"),
    ],
)
def test_ds_io_refuses_by_name(tmp_path, flags, message):
    from shardspeed.tools import io_bench

    args = ["--folder", str(tmp_path), "--io_size", "1M", *flags]
    with pytest.raises(SystemExit, match=re.escape(message)):
        io_bench.main(args)
    with pytest.raises(SystemExit, match="--folder '/no/such/folder': not an existing folder"):
        io_bench.main(["--folder", "/no/such/folder", "--io_size", "1M"])


def test_ds_nvme_tune_prints_the_best_aio_block(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["256K"], "queue_depth": [4], "io_parallel": [1, 2]}))
    data, logs = tmp_path / "nvme", tmp_path / "logs"
    data.mkdir()
    out = _run("shardspeed.tools.nvme_tune", "--nvme_dir", str(data), "--io_size", "1M", "--sweep_config",
               str(sweep), "--log_dir", str(logs), "--flush_page_cache")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    block = json.loads(out.stdout[out.stdout.index("{") :])["aio"]
    assert (
        block["block_size"] == 256 * 1024
        and block["queue_depth"] == 4
        and block["intra_op_parallelism"] in (1, 2)
    )
    assert set(block) == {
        "block_size",
        "queue_depth",
        "intra_op_parallelism",
        "single_submit",
        "overlap_events",
    }
    assert len(list((logs / "read").iterdir())) == len(list((logs / "write").iterdir())) == 2


def test_ds_nvme_tune_refuses_by_name(tmp_path):
    from shardspeed.tools import nvme_tune

    with pytest.raises(SystemExit, match="--gds: GPU transfers are not measured"):
        nvme_tune.main(["--nvme_dir", str(tmp_path), "--gds"])
    bad = tmp_path / "sweep.json"
    bad.write_text(json.dumps({"thread_count": [1]}))
    with pytest.raises(SystemExit, match=r"unknown settings \['thread_count'\]"):
        nvme_tune.main(["--nvme_dir", str(tmp_path), "--sweep_config", str(bad)])


def test_ds_ssh_runs_the_command_on_every_host(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_ssh = bin_dir / "ssh"  # records its arguments instead of connecting anywhere
    fake_ssh.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\necho "ran on $3"\n')
    fake_ssh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    env = {**os.environ, "PATH": str(bin_dir)}  # no pdsh: the ssh path (pdsh is DeepSpeed's own)
    out = _run("shardspeed.tools.ssh_all", "-f", str(hostfile), "hostname", "-s", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    calls = sorted((tmp_path / "calls").read_text().splitlines())
    assert calls == ["-o BatchMode=yes node-a hostname -s", "-o BatchMode=yes node-b hostname -s"]
    assert "node-a: ran on node-a" in out.stdout and "node-b: ran on node-b" in out.stdout
    missing = _run("shardspeed.tools.ssh_all", "-f", str(tmp_path / "nope"), "hostname", env=env)
    assert missing.returncode != 0 and f"cannot read hostfile {tmp_path / 'nope'}" in missing.stderr
