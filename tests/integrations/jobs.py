"""Run one of the integration job scripts under torchrun with the `deepspeed` alias staged (no install)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .alias_path import env_with_alias
from harness import free_port

HERE = Path(__file__).resolve().parent


def run_job(script: str, tmp_path: Path, *args: str, timeout: float = 600, nproc: int = 2) -> dict:
    """Start `script` on `nproc` ranks; return the JSON its rank 0 wrote. The job's output is shown on failure."""
    out = tmp_path / "result.json"
    env = env_with_alias(tmp_path / "site")
    env["SHARDSPEED_ACCELERATOR"] = "cpu"
    env["HF_HUB_OFFLINE"] = "1"  # everything is built from configs; never reach for the network
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(HERE / script), "--work", str(tmp_path / "work"),
           "--out", str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
