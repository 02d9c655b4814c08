"""DeepSpeed's own AutoTP checkpoints through shardspeed's `ds_to_universal`, against the real DeepSpeed 0.19.8.

DeepSpeed (DEEPSPEED_PYTHON, as in test_deepspeed_checkpoints.py; skipped without it) trains a tp 2 AutoTP run
on 2 CPU ranks and saves it (tests/deepspeed_interop/autotp_write.py: column q/k/v, row o_proj, a replicated
LayerNorm; its files carry only DeepSpeed's `universal_checkpoint_info`). Both converters write a universal
folder from it: every parameter's fp32, exp_avg and exp_avg_sq must be equal exactly, and shardspeed loads
ours at tp 1 with the whole values."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import run_ranks

TESTS = Path(__file__).resolve().parents[1]
DEEPSPEED_PYTHON = os.environ.get("DEEPSPEED_PYTHON")

pytestmark = pytest.mark.skipif(
    not DEEPSPEED_PYTHON, reason="set DEEPSPEED_PYTHON to a python with deepspeed==0.19.8 (CI does)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deepspeed(args: list, cwd: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([DEEPSPEED_PYTHON, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"DeepSpeed run {args} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def load_at_tp1(ckpt: str) -> dict:
    sys.path.insert(0, str(TESTS / "deepspeed_interop"))
    import autotp_write

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    model = autotp_write.Model()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}, "checkpoint": {"load_universal": True}}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(ckpt, tag="t_universal")
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_deepspeed_autotp_checkpoint_converts_as_deepspeed_does_and_loads(tmp_path):
    from shardspeed.checkpoint import to_universal

    ckpt = tmp_path / "ckpt"
    script = TESTS / "deepspeed_interop" / "autotp_write.py"
    _deepspeed(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
                str(script), str(ckpt)], tmp_path)  # fmt: skip
    _deepspeed(["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / "t"),
                "--output_folder", str(ckpt / "deepspeed_universal")], tmp_path)  # fmt: skip
    to_universal.main(["--input_folder", str(ckpt / "t"), "--output_folder", str(ckpt / "t_universal")])

    names = sorted(p.name for p in (ckpt / "deepspeed_universal" / "zero").iterdir() if p.is_dir())
    assert len(names) == 10, names
    whole = {}
    for name in names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            theirs = torch.load(
                ckpt / "deepspeed_universal" / "zero" / name / f"{state}.pt", weights_only=False
            )
            ours = torch.load(ckpt / "t_universal" / "zero" / name / f"{state}.pt")
            assert torch.equal(ours["param"], theirs["param"]), (name, state)
        whole[name] = ours_fp32 = torch.load(ckpt / "t_universal" / "zero" / name / "fp32.pt")["param"]
        assert ours_fp32.shape == (8, 8) or ours_fp32.shape == (8,), (
            name,
            ours_fp32.shape,
        )  # whole, not shards

    loaded = run_ranks(load_at_tp1, 1, str(ckpt))[0]
    assert sorted(loaded) == names and all(torch.equal(loaded[n], whole[n]) for n in names)
