"""HF Trainer's `resume_from_checkpoint` on a `checkpoint-4/global_step4` folder DeepSpeed 0.19.8 wrote, live.

DeepSpeed (its own interpreter, named by DEEPSPEED_PYTHON: CI's integration stage sets it; without it this test
skips, with it any failure of DeepSpeed's run fails it) runs tests/integrations/hf_trainer_job.py unchanged at
ZeRO-2: 8 steps saving at step 4, then its own resume. The same script then runs through the `deepspeed` alias,
only resuming a fresh Trainer from DeepSpeed's checkpoint-4. Steps 5-8 must log DeepSpeed's uninterrupted losses
(fp32, within 1e-6; measured: equal). `torch_adam` makes both libraries step with torch's AdamW (DeepSpeed would
otherwise JIT-build its fused kernel, minutes on a CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers, accelerate)")
pytest.importorskip("accelerate", reason="needs the [hf] extra (transformers, accelerate)")

from .jobs import HERE, run_job
from harness import free_port

DEEPSPEED_PYTHON = os.environ.get("DEEPSPEED_PYTHON")

pytestmark = pytest.mark.skipif(
    not DEEPSPEED_PYTHON, reason="set DEEPSPEED_PYTHON to a python with deepspeed==0.19.8 (CI does)"
)


def _deepspeed_run(tmp: Path) -> dict:
    out = tmp / "deepspeed.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    cmd = [DEEPSPEED_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "hf_trainer_job.py"), "--stages", "2", "--torch-adam",
           "--work", str(tmp / "deepspeed"), "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"DeepSpeed's run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(out.read_text())


def test_trainer_resumes_a_checkpoint_deepspeed_wrote(tmp_path):
    theirs = _deepspeed_run(tmp_path)["2"]
    folder = tmp_path / "deepspeed" / "stage2" / "checkpoint-4" / "global_step4"
    assert (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()  # DeepSpeed's own layout
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    ours = run_job(
        "hf_trainer_job.py", ours_dir, "--stages", "2", "--torch-adam",
        "--resume-from", str(tmp_path / "deepspeed"),
    )["2"]  # fmt: skip
    uninterrupted = [theirs["train"][str(s)] for s in range(5, 9)]
    resumed = [ours["resumed"][str(s)] for s in range(5, 9)]
    assert uninterrupted[-1] < theirs["train"]["1"] - 0.2  # DeepSpeed's run learns
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted)) <= 1e-6, (resumed, uninterrupted)
    # and DeepSpeed's own resume agrees with its uninterrupted run (the reference itself is sound)
    assert [theirs["resumed"][str(s)] for s in range(5, 9)] == pytest.approx(uninterrupted, abs=1e-6)
