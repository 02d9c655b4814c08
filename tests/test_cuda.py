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
    from shardspeed.core.placement import placement_problems

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
        problems = placement_problems(engine.module, engine.optimizer, engine.device)
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


def _offload_cases(root: str) -> dict:
    """offload_states moves the engine's state off the GPU (allocated memory falls by its bytes) and
    reload_states brings it back; the next steps equal those of an engine that never offloaded."""
    from shardspeed.zero.offload_kinds import OffloadStateTypeEnum

    out = {}
    for stage in (0, 1, 2, 3):
        for precision in PRECISIONS:
            config = _config(stage, precision, None)
            reference, engine = _engine(config), _engine(config)
            data = token_batches(4, engine.train_batch_size()).to(engine.device)
            train_engine(reference, data, range(4), 0, 1)
            train_engine(engine, data, range(2), 0, 1)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            engine.offload_states()
            torch.cuda.synchronize()
            offloaded = torch.cuda.memory_allocated()
            host = all(
                v.device.type == "cpu" for s in engine.optimizer.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            )  # fmt: skip
            engine.reload_states()
            reloaded = torch.cuda.memory_allocated()
            engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
            only_optim = torch.cuda.memory_allocated()
            engine.reload_states(non_blocking=True)
            train_engine(engine, data, range(2, 4), 0, 1)
            out[f"z{stage}-{precision}"] = {
                "before": before, "offloaded": offloaded, "reloaded": reloaded, "only_optim": only_optim,
                "host": host, "same": _same_params(reference, engine),
            }  # fmt: skip
            reference.destroy()
            engine.destroy()
    return out


def _same_params(a, b) -> bool:
    pa, pb = _cpu_params(a), _cpu_params(b)
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_offload_states_moves_memory_to_the_host_and_back(tmp_path):
    results = run_ranks(_offload_cases, 1, str(tmp_path), timeout=600)[0]
    for name, r in results.items():
        assert r["offloaded"] < r["before"] / 2, (name, r)  # most of the engine's bytes left the GPU
        assert r["before"] > r["only_optim"] > r["offloaded"], (name, r)
        assert r["reloaded"] == r["before"], (name, r)
        assert r["host"] and r["same"], (name, r)


def _autocast_cases(root: str) -> dict:
    import shardspeed

    out = {}
    for dtype in (None, "bf16", "fp16"):
        torch.manual_seed(0)
        block = {"enabled": True, **({"dtype": dtype} if dtype else {})}
        engine, *_ = shardspeed.initialize(model=TinyGPT(), config=base_config(torch_autocast=block))
        seen = []
        engine.module.head.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        data = token_batches(2, engine.train_batch_size()).to(engine.device)
        losses = train_engine(engine, data, range(2), 0, 1)
        out[dtype] = {
            "forward": seen[0], "params": {p.dtype for p in engine.module.parameters()},
            "comm": sorted({str(b.comm_dtype) for b in engine.optimizer.reducer.buckets}),
            "finite": all(torch.isfinite(torch.tensor(losses))),
        }  # fmt: skip
        engine.destroy()
    return out


def test_torch_autocast_on_cuda(tmp_path):
    results = run_ranks(_autocast_cases, 1, str(tmp_path), timeout=300)[0]
    assert results[None]["forward"] == torch.float16  # torch's CUDA default
    assert results["bf16"]["forward"] == torch.bfloat16 and results["fp16"]["forward"] == torch.float16
    for r in results.values():
        assert r["params"] == {torch.float32} and r["finite"]
    assert results["bf16"]["comm"] == ["torch.bfloat16", "torch.float32"]
