"""CUDA paths: run only where a GPU is visible (skipped, with the reason, on CPU-only machines).

One rank over NCCL (NCCL refuses two ranks on one GPU; multi-rank paths are covered on Gloo/CPU). The 14
resume cases of the GPU kit (stages 0-3 x fp16/bf16 x optimizer offload none/cpu): train, save, load into a
fresh engine, check that every tensor is where runtime/placement.py says, and continue exactly as the
uninterrupted run. Offload cases also check the host side is page-locked, so its copies are asynchronous.
"""

import copy

import pytest
import torch

from common import base_config, full_params, train_engine
from harness import run_ranks
from models import TinyGPT, token_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PRECISIONS = {
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 10}},
    "bf16": {"bf16": {"enabled": True}},
}
CASES = [(0, p, None) for p in PRECISIONS] + [
    (stage, p, offload) for stage in (1, 2, 3) for p in PRECISIONS for offload in (None, "cpu")
]


def _config(stage: int, precision: str, offload: str | None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 3000}
    if offload:
        zero["offload_optimizer"] = {"device": offload, "pin_memory": True}
    return base_config(zero_optimization=zero, **PRECISIONS[precision])


def _cpu_params(engine) -> dict:
    return {k: v.cpu() for k, v in full_params(engine).items()}


def _engine(config: dict):
    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config=copy.deepcopy(config))
    return engine


def _resume_cases(root: str) -> dict:
    from shardspeed.runtime.placement import placement_problems

    out = {}
    for stage, precision, offload in CASES:
        name = f"z{stage}-{precision}-{offload or 'none'}"
        config = _config(stage, precision, offload)
        engine = _engine(config)
        data = token_batches(5, engine.train_batch_size()).to(engine.device)
        train_engine(engine, data, range(3), 0, 1)
        engine.save_checkpoint(f"{root}/{name}")
        expected = train_engine(engine, data, range(3, 5), 0, 1), _cpu_params(engine)
        engine.destroy()

        engine = _engine(config)
        engine.load_checkpoint(f"{root}/{name}")
        problems = placement_problems(engine)
        pinned = None
        if offload:
            host_grads = engine.optimizer.host_grads
            pinned = all(b.is_pinned() for b in host_grads._buffers) and all(
                m.is_pinned() for m in engine.optimizer.masters
            )
        resumed = train_engine(engine, data, range(3, 5), 0, 1), _cpu_params(engine)
        engine.destroy()
        out[name] = {
            "device": str(engine.device), "problems": problems, "pinned": pinned,
            "expected": expected, "resumed": resumed,
        }  # fmt: skip
    return out


def test_resume_on_cuda_is_exact_and_in_place(tmp_path):
    (out,) = run_ranks(_resume_cases, 1, str(tmp_path))
    assert len(out) == 14
    for name, case in out.items():
        assert case["device"].startswith("cuda"), name
        assert case["problems"] == [], name
        assert case["pinned"] is (True if name.endswith("-cpu") else None), name
        (losses, params), (resumed_losses, resumed_params) = case["expected"], case["resumed"]
        assert resumed_losses == losses, name
        assert all(torch.equal(params[k], resumed_params[k]) for k in params), name
