"""DeepSpeed's commands after `pip install ./integrations/deepspeed-alias` (CI's second stage installs it):
`deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config ...` trains, and `ds_report`, `ds_bench`,
`ds_io`, `ds_nvme_tune`, `ds_ssh` are on the PATH. Skipped where the alias is not installed.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from .alias_path import ROOT

BIN = Path(sys.executable).parent


def _alias_installed() -> bool:
    try:
        return (
            importlib.metadata.version("deepspeed").endswith("+shardspeed") and (BIN / "deepspeed").exists()
        )
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not _alias_installed(), reason="the deepspeed alias is not installed here")


def test_deepspeed_command_trains_the_example_on_two_ranks(tmp_path):
    out = subprocess.run(
        [str(BIN / "deepspeed"), "--num_gpus", "2", "examples/train_gpt.py", "--deepspeed_config",
         "examples/configs/gpt_small.json", "--steps", "3", "--corpus_bytes", "200000", "--layers", "1",
         "--dim", "32", "--seq", "32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={"PATH": str(BIN), "GLOO_SOCKET_IFNAME": "lo"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 processes" in out.stdout and "tokens/s" in out.stdout + out.stderr


@pytest.mark.parametrize("name", ["ds_report", "ds_bench", "ds_io", "ds_nvme_tune", "ds_ssh"])
def test_deepspeeds_other_commands_are_installed(name):
    out = subprocess.run([str(BIN / name), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
