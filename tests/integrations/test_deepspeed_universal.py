"""DeepSpeed 0.19.8 itself loads a universal folder shardspeed's `ds_to_universal` wrote, and resumes the run.

shardspeed trains tests/universal_common.py's model at 2 ranks, ZeRO-2, saves at step SAVE_AT, goes on to STEPS
and converts the checkpoint; then DeepSpeed, in the interpreter `DEEPSPEED_PYTHON` names (one with DeepSpeed
0.19.8 installed, `DS_ACCELERATOR=cpu`), loads it with `"checkpoint": {"load_universal": true}` at ZeRO 1 and
3 and finishes the run (tests/fixtures/ds_universal_script.py). Its parameters right after the load must be
those saved, and at the end within 1e-6 of shardspeed's uninterrupted run. Skipped when `DEEPSPEED_PYTHON`
is unset; when it is set, any failure of the DeepSpeed job fails the test.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from universal_common import SAVE_AT, save_and_convert

from harness import run_ranks

DEEPSPEED_PYTHON = os.environ.get("DEEPSPEED_PYTHON")
SCRIPT = Path(__file__).parents[1] / "fixtures" / "ds_universal_script.py"

pytestmark = pytest.mark.skipif(
    not DEEPSPEED_PYTHON, reason="DEEPSPEED_PYTHON does not name a Python with DeepSpeed 0.19.8"
)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    root = tmp_path_factory.mktemp("ours")
    return root, run_ranks(save_and_convert, 2, str(root))[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_resumes_from_our_universal_folder(ours, stage, tmp_path):
    root, run = ours
    result = tmp_path / "result.pt"
    # DeepSpeed's own interpreter, without this checkout's paths (the `deepspeed` alias would shadow it).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"DS_ACCELERATOR": "cpu"}
    job = subprocess.run(
        [DEEPSPEED_PYTHON, str(SCRIPT), "resume", str(root), str(result), "--world", "2", "--stage", str(stage)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert job.returncode == 0, f"DeepSpeed job failed:\n{job.stdout[-4000:]}\n{job.stderr[-4000:]}"
    got = torch.load(result, weights_only=True)
    assert got["version"] == "0.19.8", got["version"]
    assert got["steps"] == SAVE_AT
    for name, saved in run["at_save"].items():
        assert torch.equal(got["params_at_load"][name], saved), name
    diff = max((got["params"][n] - run["final"][n]).abs().max().item() for n in run["final"])
    print(
        f"DeepSpeed 0.19.8 at ZeRO-{stage} from our universal folder: max |param - uninterrupted| = {diff:.2e}"
    )
    assert diff <= 1e-6 and got["lr"] == [0.01]
