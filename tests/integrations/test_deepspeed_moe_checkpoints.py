"""DeepSpeed 0.19.8's MoE checkpoints resumed by shardspeed's MoE engine, live.

DeepSpeed runs in its own interpreter, named by DEEPSPEED_PYTHON (CI's integration stage sets it; without it
these tests skip, with it any failure of DeepSpeed's runs fails them). DeepSpeed trains
tests/deepspeed_interop/moe_script.py (one `deepspeed.moe.layer.MoE` layer of 2 experts, top-1, fp32) for 3
steps at 2 ranks and saves — ep size 1 and 2, ZeRO stages 0, 1 and 2 — then trains 3 more steps. shardspeed
resumes from each save and trains the same 3 steps: at the ep size and stage it was saved at, at the other ep
size and another stage (2 ranks), and at 1 and 4 ranks. Losses and final weights (experts by global index) are
compared with DeepSpeed's uninterrupted run, within 1e-6.

In bf16 (ep size 2, ZeRO stages 0 and 2: the fp32 masters in the expp files' `fp32_groups`, or in the
`bf16_zero_pp_rank` partitions) the resumed runs, at the same and at the other ep size and stage, are compared
within 4e-3 (one bf16 rounding step at magnitude 1): the 16-bit weights shardspeed loads are DeepSpeed's bit
for bit, and the two MoE layers' bf16 arithmetic differs from the first step on.

The runs at 1 and 4 ranks train without the gate's load-balancing loss (`aux` 0), in DeepSpeed's run too: that
loss is computed over each rank's own tokens, so it changes with the world size whatever the checkpoint holds.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from harness import run_ranks

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = TESTS / "deepspeed_interop" / "moe_script.py"
TOLERANCE = 1e-6
BF16_TOLERANCE = 4e-3
DEEPSPEED_PYTHON = os.environ.get("DEEPSPEED_PYTHON")
# DeepSpeed keeps its expert groups in module globals: the ep-1 runs go first, so that no larger group made by
# an earlier run decides which ranks write (as in a fresh process).
SAVED = [(1, 0), (1, 2), (2, 0), (2, 1), (2, 2)]

pytestmark = pytest.mark.skipif(
    not DEEPSPEED_PYTHON, reason="set DEEPSPEED_PYTHON to a python with deepspeed==0.19.8 (CI does)"
)


def _deepspeed_jobs(jobs: list, tmp: Path) -> None:
    path = tmp / "deepspeed-jobs.json"
    path.write_text(json.dumps(jobs))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
    done = subprocess.run(
        [DEEPSPEED_PYTHON, str(SCRIPT), "--world", "2", "--jobs", str(path)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"DeepSpeed's MoE runs failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def _shardspeed_jobs(jobs: list) -> None:
    import torch.distributed as dist
    from deepspeed_interop.moe_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    for job in jobs:
        result = run(
            shardspeed, dist.get_world_size(), job["ep"], job["stage"], load=job["load"], aux=job["aux"],
            dtype=job.get("dtype", "fp32"),
        )  # fmt: skip
        if dist.get_rank() == 0:
            torch.save(result, job["out"])
        dist.barrier()


def _assert_resumed(jobs: list, resumer: str, tolerance: float, with_world: bool = True) -> None:
    """Each resumed run (`out`) against the writing library's uninterrupted one (`expected`): the same counters
    and parameter names, losses and final weights within `tolerance`; every job is compared before failing."""
    failures = []
    for job in jobs:
        got, expected = torch.load(job["out"]), torch.load(job["expected"])
        assert got["counters"] == expected["counters"], (job, got["counters"], expected["counters"])
        assert sorted(got["weights"]) == sorted(expected["weights"]), job
        loss = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"]))
        weights = max((got["weights"][n] - w).abs().max().item() for n, w in expected["weights"].items())
        label = f"{Path(job['expected']).stem} -> {resumer} ep {job['ep']} stage {job['stage']}"
        if with_world:
            label += f" at {job['world']}"
        print(f"{label}: max loss difference {loss:.3g}, max weight difference {weights:.3g}")
        if loss > tolerance or weights > tolerance:
            failures.append(f"{label}: losses differ by {loss}, weights by {weights}")
    assert failures == []


def test_deepspeed_moe_checkpoints_resume_in_shardspeed(tmp_path):
    saves = {
        (ep, stage, aux): {"ep": ep, "stage": stage, "aux": aux, "save": str(tmp_path / f"ds-ep{ep}-s{stage}-{aux}"),
                           "out": str(tmp_path / f"ds-ep{ep}-s{stage}-{aux}.pt")}
        for ep, stage, aux in [*[(ep, s, 0.01) for ep, s in SAVED], (2, 2, 0.0)]
    }  # fmt: skip
    _deepspeed_jobs(list(saves.values()), tmp_path)

    def resume(saved: tuple, ep: int, stage: int, world: int) -> dict:
        source = saves[saved]
        out = f"{source['out']}-as-ep{ep}-s{stage}-w{world}.pt"
        return {"ep": ep, "stage": stage, "aux": source["aux"], "load": source["save"], "out": out,
                "expected": source["out"], "world": world}  # fmt: skip

    jobs = [resume((ep, s, 0.01), ep, s, 2) for ep, s in SAVED]  # as saved
    jobs += [resume((2, 2, 0.01), 1, 0, 2), resume((1, 0, 0.01), 2, 2, 2), resume((2, 0, 0.01), 1, 1, 2),
             resume((1, 2, 0.01), 2, 0, 2), resume((2, 1, 0.01), 1, 2, 2)]  # fmt: skip
    jobs += [resume((2, 2, 0.0), 1, 2, 1), resume((2, 2, 0.0), 2, 0, 4), resume((2, 2, 0.0), 1, 1, 4)]
    for world in (2, 1, 4):
        run_ranks(_shardspeed_jobs, world, [j for j in jobs if j["world"] == world], timeout=600)

    _assert_resumed(jobs, "shardspeed", TOLERANCE)


def test_deepspeed_bf16_moe_checkpoints_resume_in_shardspeed(tmp_path):
    saves = {
        stage: {"ep": 2, "stage": stage, "aux": 0.01, "dtype": "bf16", "save": str(tmp_path / f"ds-bf16-s{stage}"),
                "out": str(tmp_path / f"ds-bf16-s{stage}.pt")}
        for stage in (0, 2)
    }  # fmt: skip
    _deepspeed_jobs(list(saves.values()), tmp_path)
    jobs = [
        {**saves[saved], "save": None, "load": saves[saved]["save"], "ep": ep, "stage": stage,
         "out": f"{saves[saved]['out']}-as-ep{ep}-s{stage}.pt", "expected": saves[saved]["out"]}
        for saved, ep, stage in [(0, 2, 0), (2, 2, 2), (0, 1, 2), (2, 1, 0)]
    ]  # fmt: skip
    run_ranks(_shardspeed_jobs, 2, jobs, timeout=600)
    _assert_resumed(jobs, "shardspeed", BF16_TOLERANCE, with_world=False)


# -- the other way: shardspeed writes, DeepSpeed resumes ------------------------------------------------------


def _shardspeed_saves(jobs: list) -> None:
    import torch.distributed as dist
    from deepspeed_interop.moe_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    for job in jobs:
        result = run(
            shardspeed, dist.get_world_size(), job["ep"], job["stage"], save=job["save"], aux=job["aux"]
        )
        if dist.get_rank() == 0:
            torch.save(result, job["out"])
        dist.barrier()


def test_shardspeed_moe_checkpoints_resume_in_deepspeed(tmp_path):
    """shardspeed trains and saves (2 ranks; ep 1 and 2; ZeRO 0-3); `shardspeed-to-deepspeed` writes each save in
    DeepSpeed's MoE layout — at the saved stage, at another stage, and one at 4 ranks; DeepSpeed's
    `load_checkpoint` resumes it and trains the same 3 steps as shardspeed's uninterrupted run (within 1e-6)."""
    from shardspeed.checkpoint.deepspeed_format.write import write_deepspeed_checkpoint

    saves = {
        (ep, stage, aux): {"ep": ep, "stage": stage, "aux": aux, "save": str(tmp_path / f"ss-ep{ep}-s{stage}-{aux}"),
                           "out": str(tmp_path / f"ss-ep{ep}-s{stage}-{aux}.pt")}
        for ep, stage, aux in [*[(ep, s, 0.01) for ep, s in SAVED], (2, 3, 0.01), (2, 2, 0.0)]
    }  # fmt: skip
    run_ranks(_shardspeed_saves, 2, list(saves.values()), timeout=600)

    def written(saved: tuple, stage: int, world: int = 2) -> dict:
        source = saves[saved]
        folder = write_deepspeed_checkpoint(source["save"], f"{source['save']}-ds-s{stage}-w{world}",
                                            world_size=world, zero_stage=stage)  # fmt: skip
        return {"ep": saved[0], "stage": stage, "aux": saved[2], "load": str(folder.parent), "world": world,
                "out": f"{folder.parent}.pt", "expected": source["out"]}  # fmt: skip

    jobs = [written((ep, s, 0.01), s) for ep, s in SAVED]  # as saved (ep 1 first: DeepSpeed's module globals)
    jobs += [written((2, 2, 0.01), 0), written((2, 0, 0.01), 1), written((1, 2, 0.01), 0)]  # another stage
    # shardspeed runs MoE at ZeRO-3, DeepSpeed does not: written for ZeRO-2
    jobs += [written((2, 3, 0.01), 2)]
    jobs += [written((2, 2, 0.0), 2, world=4)]  # 4 ranks: ep 2 over 2 expert-data-parallel ranks
    for world in (2, 4):
        mine = [j for j in jobs if j["world"] == world]
        mine.sort(key=lambda j: j["ep"])
        path = tmp_path / f"deepspeed-resumes-w{world}.json"
        path.write_text(json.dumps(mine))
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
        done = subprocess.run([DEEPSPEED_PYTHON, str(SCRIPT), "--world", str(world), "--jobs", str(path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, (
            f"DeepSpeed's resumes failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )

    _assert_resumed(jobs, "DeepSpeed", TOLERANCE)
