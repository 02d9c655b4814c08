"""Every tensor a checkpoint load creates lands where the live one lives (runtime/placement.py's table).

A GPU resume once crashed at the first step after loading: the ZeRO fast path cloned the optimizer state as
the file held it (CPU) next to CUDA masters. On a CPU-only machine a wrong device cannot be seen, so these
tests load through a `torch.load` that hands back every floating tensor as float64 — "saved somewhere else"
— and require that the engine still puts every optimizer-state tensor on its master's device *and dtype*,
then that training continues exactly as if it had never stopped (float64 holds fp32/bf16/fp16 values
exactly, so a correct placement is bit-exact). The same cases run on CUDA in test_cuda.py.
"""

import copy

import torch

from common import base_config, full_params, train_engine
from harness import run_ranks
from models import TinyGPT, token_batches

FP16 = {"fp16": {"enabled": True, "initial_scale_power": 10}}
BF16 = {"bf16": {"enabled": True}}
CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


def _zero(stage: int, **extra) -> dict:
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, **extra}}


VARIANTS = {
    "z0-fp16": base_config(**_zero(0), **FP16),
    "z1-fp16": base_config(**_zero(1), **FP16),
    "z2-bf16": base_config(**_zero(2), **BF16),
    "z3-fp16": base_config(**_zero(3), **FP16),
    "z1-bf16-cpu": base_config(**_zero(1, **CPU_OFFLOAD), **BF16),
    "z3-fp16-cpu": base_config(**_zero(3, **CPU_OFFLOAD), **FP16),
}
# Loaded by an engine of another stage: the resharding path (checkpoint/universal.py) places state too.
CROSS = {"z2-bf16": base_config(**_zero(3), **BF16), "z3-fp16": base_config(**_zero(1), **FP16)}


def _engine(config: dict):
    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config=copy.deepcopy(config))
    return engine


def _as_float64(obj):
    if torch.is_tensor(obj):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _as_float64(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_as_float64(v) for v in obj)
    return obj


def _loads_as_float64():
    """Make every checkpoint read in this process return float64 floating tensors."""
    real_load = torch.load
    torch.load = lambda *args, **kwargs: _as_float64(real_load(*args, **kwargs))


def _cases(root: str, world: int) -> dict:
    import torch.distributed as dist

    from shardspeed.core.placement import placement_problems

    out = {}
    for name, config in VARIANTS.items():
        engine = _engine(config)
        rank = dist.get_rank()
        data = token_batches(4, engine.train_batch_size())
        train_engine(engine, data, range(2), rank, world)
        engine.save_checkpoint(f"{root}/{name}")
        expected = train_engine(engine, data, range(2, 4), rank, world), full_params(engine)
        engine.destroy()
        fresh = _engine(config)
        out[name] = {
            "expected": expected,
            "fresh_problems": placement_problems(fresh.module, fresh.optimizer, fresh.device),
        }

    _loads_as_float64()
    for name, config in [*VARIANTS.items(), *((f"{n}->other", c) for n, c in CROSS.items())]:
        engine = _engine(config)
        engine.load_checkpoint(f"{root}/{name.removesuffix('->other')}")
        problems = placement_problems(engine.module, engine.optimizer, engine.device)
        data = token_batches(4, engine.train_batch_size())
        out.setdefault(name, {}).update(
            problems=problems,
            resumed=(train_engine(engine, data, range(2, 4), rank, world), full_params(engine)),
        )
        engine.destroy()
    return out


def test_loaded_state_lives_where_the_live_state_lives(tmp_path):
    results = run_ranks(_cases, 2, str(tmp_path), 2)
    for out in results:
        for name, case in out.items():
            assert case["problems"] == [], name
            if "expected" not in case:
                continue  # a cross-stage load: placement only (resharded fp32 masters may round)
            assert case["fresh_problems"] == [], name
            (losses, params), (resumed_losses, resumed_params) = case["expected"], case["resumed"]
            assert resumed_losses == losses, name
            assert all(torch.equal(params[k], resumed_params[k]) for k in params), name


def _nvme_case(root: str) -> list[str]:
    from shardspeed.core.placement import placement_problems

    config = base_config(
        **_zero(2, offload_optimizer={"device": "nvme", "nvme_path": f"{root}/swap"}), **BF16
    )
    engine = _engine(config)
    train_engine(engine, token_batches(2, engine.train_batch_size()), range(2), 0, 1)
    engine.save_checkpoint(f"{root}/ckpt")
    engine.destroy()
    _loads_as_float64()
    engine = _engine(config)
    engine.load_checkpoint(f"{root}/ckpt")
    with engine.optimizer._resident_state():  # read the swapped state back to check it too
        return placement_problems(engine.module, engine.optimizer, engine.device)


def test_nvme_swapped_state_is_placed_on_load(tmp_path):
    assert run_ranks(_nvme_case, 1, str(tmp_path)) == [[]]
