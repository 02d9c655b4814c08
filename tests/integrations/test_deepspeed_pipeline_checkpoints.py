"""DeepSpeed 0.19.8's PipelineEngine writes, shardspeed's PipelineEngine resumes, live.

DeepSpeed runs tests/deepspeed_interop/pipe_script.py in its own interpreter (DEEPSPEED_PYTHON, set by CI's
integration stage; without it these tests skip, with it any failure of DeepSpeed's run fails them): a tiny
PipelineModule at 2 ranks as 2 stages, ZeRO stage 1, fp32, 3 steps, a save, 3 more steps. shardspeed resumes
from the save as 2 stages x 1 replica (DeepSpeed's layout), 1 stage at 1 rank, and
2 stages x 2 replicas, and trains the same 3 steps: losses and final weights within 1e-6 of DeepSpeed's
uninterrupted run.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from harness import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "deepspeed_interop" / "pipe_script.py"
DEEPSPEED_PYTHON = os.environ.get("DEEPSPEED_PYTHON")
TOLERANCE = 1e-6

pytestmark = pytest.mark.skipif(
    not DEEPSPEED_PYTHON, reason="set DEEPSPEED_PYTHON to a python with deepspeed==0.19.8 (CI does)"
)


def _resume(load: str, stages: int, out: str) -> None:
    import torch.distributed as dist
    from deepspeed_interop.pipe_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    result = run(shardspeed, dist.get_world_size(), stages, 1, out, load=load)
    if dist.get_rank() == 0:
        torch.save(result, out)


def test_deepspeed_pipeline_checkpoint_resumes_at_every_layout(tmp_path):
    save, expected = tmp_path / "ds-pipe", tmp_path / "ds-pipe.pt"
    args = [
        str(SCRIPT),
        "--world",
        "2",
        "--stages",
        "2",
        "--stage",
        "1",
        "--save",
        str(save),
        "--out",
        str(expected),
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
    done = subprocess.run([DEEPSPEED_PYTHON, *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"DeepSpeed run failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    want = torch.load(expected)
    failures = []
    for world, stages in [
        (2, 2),
        (1, 1),
        (4, 2),
    ]:  # 1 stage x 2 replicas: tests/test_deepspeed_pipeline_read.py
        out = str(tmp_path / f"resumed-{world}-{stages}.pt")
        run_ranks(_resume, world, str(save), stages, out, timeout=300)
        got = torch.load(out)
        loss = max(abs(a - b) for a, b in zip(got["losses"], want["losses"]))
        weights = max((got["weights"][n] - w).abs().max().item() for n, w in want["weights"].items())
        print(
            f"DeepSpeed pipe 2x1 -> shardspeed {stages} stages x {world // stages}: loss {loss:.3g}, weights {weights:.3g}"
        )
        if sorted(got["weights"]) != sorted(want["weights"]) or got["counters"] != want["counters"]:
            failures.append(
                f"{world}/{stages}: names or counters differ: {got['counters']} vs {want['counters']}"
            )
        if loss > TOLERANCE or weights > TOLERANCE:
            failures.append(f"{world}/{stages}: losses differ by {loss}, weights by {weights}")
    assert failures == []
