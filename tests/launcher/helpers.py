"""Shared helpers for the launcher tests: run the `shardspeed` CLI, read what probe ranks saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PROBE = str(HERE / "probe_rank.py")
TRAIN = str(HERE / "train_tiny.py")


def launcher_env(**extra: str) -> dict[str, str]:
    """The test's environment for the launcher: Gloo kept on loopback, nothing inherited that changes it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDSPEED_TEST_", "CUDA_VISIBLE"))}
    env.update(GLOO_SOCKET_IFNAME="lo", SHARDSPEED_TIMEOUT="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def run_cli(args: list[str], env: dict[str, str] | None = None, cwd: str | None = None, timeout: float = 120):
    """Run `python -m shardspeed.launcher.runner ARGS`; returns the CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-m", "shardspeed.launcher.runner", *args],
        env=env or launcher_env(),
        cwd=cwd or str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def read_ranks(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (PID 1 here may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# Tests that rely on "no hostfile" skip where the default /job/hostfile exists (a real cluster node).
needs_no_default_hostfile = pytest.mark.skipif(
    os.path.exists("/job/hostfile"), reason="/job/hostfile exists here; these tests need the no-hostfile path"
)


def write_hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)
