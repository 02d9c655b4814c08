"""Per-rank model-state memory follows the ZeRO formulas, as the engine accounts it.

Wall-clock and RSS targets live in benchmarks/; here the engine's own accounting (bytes of the tensors it
holds) is checked against `estimate`, the ZeRO paper's formula, for every stage.
"""

import pytest
import torch
from torch import nn

from shardspeed.core.memory import estimate

from harness import run_ranks

WORLD = 2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])  # 132k parameters, 8 units/buckets


def _measure(stage: int, dtype: str) -> dict:
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 20000,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    engine, *_ = shardspeed.initialize(model=_mlp(), config=config)
    for _ in range(2):
        x = torch.randn(4, 128, dtype=next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return {"bytes": engine.memory_breakdown(), "params": sum(p.numel() for p in _mlp().parameters())}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_model_states_match_the_zero_formula(dtype):
    for stage in range(4):
        measured = run_ranks(_measure, WORLD, stage, dtype)[0]
        expected = estimate(measured["params"], WORLD, stage, dtype).as_dict()
        for key in ("params", "grads", "master_weights", "optimizer_state"):
            # Off only by Adam's scalar `step` per stepped tensor and padding to a multiple of the world size.
            assert abs(measured["bytes"][key] - expected[key]) <= 256, (stage, key, measured)
        assert measured["bytes"]["buffers"] == 0  # nothing left in flight between steps
