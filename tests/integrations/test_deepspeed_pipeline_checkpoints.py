"""DeepSpeed 0.19.8's PipelineEngine writes, shardspeed's PipelineEngine resumes, live.

DeepSpeed runs tests/deepspeed_interop/pipe_script.py in its own interpreter (DEEPSPEED_PYTHON, set by CI's
integration stage; without it these tests skip, with it any failure of DeepSpeed's run fails them): a tiny
PipelineModule as 2 stages, 3 steps, a save, 3 more steps; at ZeRO stage 1 and 0, in fp32 and bf16 (at ZeRO 0 in
bf16 DeepSpeed runs its BF16_Optimizer; at ZeRO 0 in fp32 its files name no parameters). shardspeed resumes from
each save at several layouts (stages x replicas, and ZeRO stage) and trains the same 3 steps: losses and final
weights within 1e-6 of DeepSpeed's uninterrupted run in fp32, within 4e-3 (one bf16 rounding step at magnitude
1) in bf16, where the first loss after the load, computed from the loaded weights alone, must still agree within
1e-6.

The other way: shardspeed's PipelineEngine trains the same script (2 stages at 2 ranks) and saves;
`shardspeed-to-deepspeed` writes the save in DeepSpeed's pipeline layout (at ZeRO 1 and 0, and at 2 replicas);
DeepSpeed's PipelineEngine resumes from it and trains the same 3 steps, within the same tolerances of
shardspeed's uninterrupted run.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from harness import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "deepspeed_interop" / "pipe_script.py"
DEEPSPEED_PYTHON = os.environ.get("DEEPSPEED_PYTHON")
TOLERANCE = {"fp32": 1e-6, "bf16": 4e-3}

# (DeepSpeed's world, ZeRO stage, dtype) -> the (world, stages, ZeRO stage) layouts shardspeed resumes at.
# DeepSpeed always saves 2 stages; 1 stage x 2 replicas of the first case: tests/test_deepspeed_pipeline_read.py
CASES = {
    (2, 1, "fp32"): [(2, 2, 1), (1, 1, 1), (4, 2, 1)],
    (2, 1, "bf16"): [(2, 2, 1), (2, 1, 1)],
    (2, 0, "fp32"): [(2, 2, 0), (4, 2, 0), (2, 1, 1)],
    (2, 0, "bf16"): [(2, 2, 0), (1, 1, 1)],
    (4, 0, "bf16"): [(4, 2, 0), (2, 1, 1)],  # 2 replicas: each BF16_Optimizer file names only its own slice
}

pytestmark = pytest.mark.skipif(
    not DEEPSPEED_PYTHON, reason="set DEEPSPEED_PYTHON to a python with deepspeed==0.19.8 (CI does)"
)


def _save(save: str, zero: int, dtype: str, out: str) -> None:
    import torch.distributed as dist
    from deepspeed_interop.pipe_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    result = run(shardspeed, dist.get_world_size(), 2, zero, out, save=save, dtype=dtype)
    if dist.get_rank() == 0:
        torch.save(result, out)


def _resume(load: str, stages: int, zero: int, dtype: str, out: str) -> None:
    import torch.distributed as dist
    from deepspeed_interop.pipe_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    result = run(shardspeed, dist.get_world_size(), stages, zero, out, load=load, dtype=dtype)
    if dist.get_rank() == 0:
        torch.save(result, out)


@pytest.mark.parametrize("case", list(CASES), ids=[f"{w} ranks ZeRO-{z} {d}" for w, z, d in CASES])
def test_deepspeed_pipeline_checkpoint_resumes_at_every_layout(tmp_path, case):
    ds_world, ds_zero, dtype = case
    save, expected = tmp_path / "ds-pipe", tmp_path / "ds-pipe.pt"
    args = [str(SCRIPT), "--world", str(ds_world), "--stages", "2", "--stage", str(ds_zero), "--dtype", dtype]
    args += ["--save", str(save), "--out", str(expected)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
    done = subprocess.run([DEEPSPEED_PYTHON, *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"DeepSpeed run failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    want = torch.load(expected)
    failures = []
    for world, stages, zero in CASES[case]:
        out = str(tmp_path / f"resumed-{world}-{stages}-{zero}.pt")
        run_ranks(_resume, world, str(save), stages, zero, dtype, out, timeout=300)
        got = torch.load(out)
        first = abs(got["losses"][0] - want["losses"][0])
        loss = max(abs(a - b) for a, b in zip(got["losses"], want["losses"]))
        weights = max((got["weights"][n] - w).abs().max().item() for n, w in want["weights"].items())
        print(
            f"DeepSpeed pipe {ds_world} ranks ZeRO-{ds_zero} {dtype} -> shardspeed {stages} stages x "
            f"{world // stages} ZeRO-{zero}: loss {loss:.3g}, weights {weights:.3g}"
        )
        if sorted(got["weights"]) != sorted(want["weights"]) or got["counters"] != want["counters"]:
            failures.append(
                f"{world}/{stages}/{zero}: names or counters differ: {got['counters']} vs {want['counters']}"
            )
        if loss > TOLERANCE[dtype] or weights > TOLERANCE[dtype] or first > TOLERANCE["fp32"]:
            failures.append(
                f"{world}/{stages}/{zero}: losses differ by {loss} (first {first}), weights by {weights}"
            )
    assert failures == []


# (shardspeed's ZeRO stage, dtype) -> the (DeepSpeed world, ZeRO stage) it is written at and DeepSpeed resumes at
WRITTEN = {(1, "fp32"): [(2, 1), (2, 0), (4, 1)], (1, "bf16"): [(2, 1)], (0, "fp32"): [(2, 0)]}


@pytest.mark.parametrize("case", list(WRITTEN), ids=[f"ZeRO-{z} {d}" for z, d in WRITTEN])
def test_shardspeed_pipeline_checkpoint_resumes_in_deepspeed(tmp_path, case):
    from shardspeed.checkpoint.deepspeed_format.write import write_deepspeed_checkpoint

    zero, dtype = case
    ours, expected = tmp_path / "ours", tmp_path / "ours.pt"
    run_ranks(_save, 2, str(ours), zero, dtype, str(expected), timeout=300)
    want = torch.load(expected)
    failures = []
    for world, ds_zero in WRITTEN[case]:
        folder = tmp_path / f"ds-{world}-{ds_zero}"
        write_deepspeed_checkpoint(ours, folder, world_size=world // 2, zero_stage=ds_zero)
        out = tmp_path / f"ds-{world}-{ds_zero}.pt"
        args = [
            str(SCRIPT),
            "--world",
            str(world),
            "--stages",
            "2",
            "--stage",
            str(ds_zero),
            "--dtype",
            dtype,
        ]
        args += ["--load", str(folder), "--out", str(out)]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
        done = subprocess.run(
            [DEEPSPEED_PYTHON, *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, (
            f"DeepSpeed's resume failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
        got = torch.load(out)
        loss = max(abs(a - b) for a, b in zip(got["losses"], want["losses"]))
        weights = max((got["weights"][n] - w).abs().max().item() for n, w in want["weights"].items())
        print(
            f"shardspeed pipe ZeRO-{zero} {dtype} -> DeepSpeed 2 stages x {world // 2} ZeRO-{ds_zero}: "
            f"loss {loss:.3g}, weights {weights:.3g}"
        )
        if sorted(got["weights"]) != sorted(want["weights"]) or got["counters"] != want["counters"]:
            failures.append(
                f"{world}/{ds_zero}: names or counters differ: {got['counters']} vs {want['counters']}"
            )
        if loss > TOLERANCE[dtype] or weights > TOLERANCE[dtype]:
            failures.append(f"{world}/{ds_zero}: losses differ by {loss}, weights by {weights}")
    assert failures == []
