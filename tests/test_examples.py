"""The README's main job runs under torchrun and under plain `python` (a world of one)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "12", "--dim", "32", "--layers", "1", "--seq", "32", "--corpus_bytes", "200000"]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _losses(output: str) -> tuple[float, float]:
    match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", output)
    assert match, output[-2000:]
    return float(match.group(1)), float(match.group(2))


@pytest.mark.parametrize("config", ["gpt_small.json", "gpt_fp16.json"])
def test_example_under_torchrun(config):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "examples/train_gpt.py", "--deepspeed_config", f"examples/configs/{config}", *SMALL]  # fmt: skip
    output = _run(cmd)
    first, last = _losses(output)
    assert last < first  # it learns
    assert "2 processes" in output


def test_example_under_plain_python(tmp_path):
    output = _run([sys.executable, "examples/train_gpt.py", "--deepspeed_config", "examples/configs/gpt_small.json",
                   "--save_dir", str(tmp_path), *SMALL])  # fmt: skip
    assert "1 processes" in output
    assert (tmp_path / "latest").read_text() == "global_step12"


def test_example_turns_on_checkpointing_monitor_profiler_and_comms_logger(tmp_path):
    config = json.loads((ROOT / "examples/configs/gpt_observe.json").read_text())
    config["csv_monitor"]["output_path"] = str(tmp_path)
    path = tmp_path / "observe.json"
    path.write_text(json.dumps(config))
    output = _run([sys.executable, "examples/train_gpt.py", "--deepspeed_config", str(path), *SMALL])
    first, last = _losses(output)
    assert last < first
    assert "Profile Summary at step 2:" in output  # the flops profiler's report
    assert "Comm. Op" in output and "all_gather_into_tensor" in output  # the comms logger's table
    lines = (tmp_path / "gpt" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert lines[0] == "step,train_loss" and len(lines) == 1 + 12
