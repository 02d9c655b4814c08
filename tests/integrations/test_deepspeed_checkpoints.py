"""Checkpoints interchange with the real DeepSpeed 0.19.8, both ways, live.

DeepSpeed runs in its own interpreter, named by the environment variable DEEPSPEED_PYTHON (CI's integration
stage makes a virtual environment with torch==2.13.0 and deepspeed==0.19.8 and sets it). Without the variable
these tests skip; with it, any failure of DeepSpeed's runs fails them.

1. DeepSpeed writes, shardspeed resumes: DeepSpeed trains tests/deepspeed_interop/run_script.py for 3 steps at
   2 ranks and saves (ZeRO 0-3 x fp32/bf16), then trains 3 more steps; shardspeed's `load_checkpoint` resumes
   from each save and trains the same 3 steps (at 2 ranks, and the ZeRO-2 fp32 one at 1 rank).
2. shardspeed writes, DeepSpeed resumes: shardspeed does the same; `shardspeed-to-deepspeed` writes each
   checkpoint in DeepSpeed's layout; DeepSpeed's `load_checkpoint` resumes from it, and the zero_to_fp32.py that
   DeepSpeed ships, run as a script, consolidates it (stages 1-3: the script reads ZeRO checkpoints only) to
   the weights shardspeed's consolidation gives.

Losses and final weights are compared with the writing library's uninterrupted run: fp32 within 1e-6, bf16
within 4e-3 (one bf16 rounding step at magnitude 1).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from harness import run_ranks

TESTS = Path(__file__).resolve().parents[1]

SCRIPT = TESTS / "deepspeed_interop" / "run_script.py"
CASES = [(stage, dtype) for dtype in ("fp32", "bf16") for stage in range(4)]
TOLERANCE = {"fp32": 1e-6, "bf16": 4e-3}  # bf16: one rounding step (2**-8) at magnitude 1; measured <= 9.9e-4
DEEPSPEED_PYTHON = os.environ.get("DEEPSPEED_PYTHON")

pytestmark = pytest.mark.skipif(
    not DEEPSPEED_PYTHON, reason="set DEEPSPEED_PYTHON to a python with deepspeed==0.19.8 (CI does)"
)


def _deepspeed(args: list, cwd: Path) -> None:
    """Run DeepSpeed's side; its failure fails the test, with DeepSpeed's output."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
    done = subprocess.run([DEEPSPEED_PYTHON, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"DeepSpeed run {args} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def _deepspeed_jobs(jobs: list, tmp: Path, world: int = 2) -> None:
    path = tmp / f"jobs-{len(list(tmp.glob('jobs-*')))}.json"
    path.write_text(json.dumps(jobs))
    _deepspeed([str(SCRIPT), "--world", str(world), "--jobs", str(path)], tmp)


def _shardspeed_jobs(jobs: list) -> None:
    """In every rank: run_script's runs with shardspeed, results written by rank 0."""
    import torch.distributed as dist
    from deepspeed_interop.run_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    for job in jobs:
        result = run(
            shardspeed, dist.get_world_size(), job["stage"], job["dtype"], job.get("save"), job.get("load")
        )
        if dist.get_rank() == 0:
            torch.save(result, job["out"])
        dist.barrier()


def _differences(got: Path, expected: Path) -> tuple[float, float]:
    a, b = torch.load(got), torch.load(expected)
    assert a["counters"] == b["counters"], (got, a["counters"], b["counters"])
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    weights = max((a["weights"][n] - w).abs().max().item() for n, w in b["weights"].items())
    return loss, weights


def _check(pairs: dict) -> None:
    failures = []
    for label, (got, expected, dtype) in pairs.items():
        loss, weights = _differences(got, expected)
        print(f"{label}: max loss difference {loss:.3g}, max weight difference {weights:.3g}")
        if loss > TOLERANCE[dtype] or weights > TOLERANCE[dtype]:
            failures.append(f"{label}: losses differ by {loss}, weights by {weights}")
    assert failures == []


def test_deepspeed_writes_shardspeed_resumes(tmp_path):
    saves = [
        {
            "stage": s,
            "dtype": d,
            "save": str(tmp_path / f"ds-s{s}-{d}"),
            "out": str(tmp_path / f"ds-s{s}-{d}.pt"),
        }
        for s, d in CASES
    ]
    _deepspeed_jobs(saves, tmp_path)
    resumes = [
        {"stage": j["stage"], "dtype": j["dtype"], "load": j["save"], "out": j["out"] + ".resumed.pt"}
        for j in saves
    ]
    run_ranks(_shardspeed_jobs, 2, resumes, timeout=600)
    one_rank = [
        {"stage": 2, "dtype": "fp32", "load": saves[2]["save"], "out": str(tmp_path / "at-1-rank.pt")}
    ]
    run_ranks(_shardspeed_jobs, 1, one_rank, timeout=300)
    pairs = {f"DeepSpeed s{j['stage']} {j['dtype']} -> shardspeed": (r["out"], j["out"], j["dtype"])
             for j, r in zip(saves, resumes)}  # fmt: skip
    pairs["DeepSpeed s2 fp32 at 2 ranks -> shardspeed at 1"] = (one_rank[0]["out"], saves[2]["out"], "fp32")
    _check(pairs)


def _zero_to_fp32_script() -> str:
    """The zero_to_fp32.py of DeepSpeed's install (which DeepSpeed copies into its checkpoint folders)."""
    find = "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('deepspeed').origin))"
    # DeepSpeed's own package, never the alias a PYTHONPATH may put first
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([DEEPSPEED_PYTHON, "-c", find], capture_output=True, text=True, check=True, env=env)
    return os.path.join(done.stdout.strip(), "utils", "zero_to_fp32.py")


def test_shardspeed_writes_deepspeed_resumes_and_consolidates(tmp_path):
    from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
    from shardspeed.checkpoint.deepspeed_format.write import write_deepspeed_checkpoint

    saves = [
        {
            "stage": s,
            "dtype": d,
            "save": str(tmp_path / f"ss-s{s}-{d}"),
            "out": str(tmp_path / f"ss-s{s}-{d}.pt"),
        }
        for s, d in CASES
    ]
    run_ranks(_shardspeed_jobs, 2, saves, timeout=600)
    for job in saves:
        write_deepspeed_checkpoint(job["save"], job["save"] + "-ds")
    resumes = [
        {"stage": j["stage"], "dtype": j["dtype"], "load": j["save"] + "-ds", "out": j["out"] + ".resumed.pt"}
        for j in saves
    ]
    _deepspeed_jobs(resumes, tmp_path)
    _check({f"shardspeed s{j['stage']} {j['dtype']} -> DeepSpeed": (r["out"], j["out"], j["dtype"])
            for j, r in zip(saves, resumes)})  # fmt: skip

    script = _zero_to_fp32_script()
    for job in saves:
        if job["stage"] == 0:
            continue
        out = Path(job["save"] + "-fp32")
        # run as DeepSpeed runs it: copied into the checkpoint folder (from DeepSpeed's own folder, its
        # utils/types.py would shadow the standard library's `types`)
        shutil.copy(script, job["save"] + "-ds")
        _deepspeed(
            [str(Path(job["save"] + "-ds") / "zero_to_fp32.py"), job["save"] + "-ds", str(out)], tmp_path
        )
        theirs = torch.load(out / "pytorch_model.bin", weights_only=True)
        ours = get_fp32_state_dict_from_zero_checkpoint(job["save"])
        assert sorted(theirs) == sorted(ours), (job, sorted(theirs), sorted(ours))
        worst = max((theirs[k].float() - ours[k].float()).abs().max().item() for k in ours)
        print(f"zero_to_fp32.py on shardspeed s{job['stage']} {job['dtype']}: max difference {worst:.3g}")
        assert worst == 0.0, (job, worst)
