"""Lightning's DeepSpeedStrategy at ZeRO stage 2 on a small LightningModule, 2 ranks (see lightning_job.py
for the two CUDA-only checks of Lightning's that the job leaves out on a CPU-only machine).

Needs lightning (the `[hf]` extra) and `shardspeed.checkpointing`, which Lightning's strategy configures on
every run (`deepspeed.checkpointing.configure`); skipped without them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="needs the [hf] extra (lightning)")
pytest.importorskip("shardspeed.checkpointing", reason="Lightning calls deepspeed.checkpointing.configure")

from .jobs import run_job


def test_lightning_deepspeed_strategy_stage_2_trains_saves_and_resumes(tmp_path):
    results = run_job("lightning_job.py", tmp_path)
    train = [results["train"][str(s)] for s in range(1, 9)]
    assert sum(train[4:]) < sum(train[:4])  # it learns
    assert (tmp_path / "work" / "step4.ckpt" / "latest").read_text().strip() == "checkpoint"
    resumed = [results["resumed"][str(s)] for s in range(5, 9)]
    # The first step after `fit(ckpt_path=...)` sees exactly the saved weights. Later steps drift by ~1e-3
    # under Lightning only (not under the engine, Trainer or Accelerate, which resume bit-exactly): an open
    # issue listed in docs/compatibility.md, so only the restored state is checked here.
    assert abs(resumed[0] - train[4]) <= 1e-6, (resumed, train[4:])
    assert all(abs(a - b) < 0.25 for a, b in zip(resumed, train[4:])), (resumed, train[4:])
