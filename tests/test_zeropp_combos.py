"""ZeRO++ with the rest of stage 3: fp16 and bf16, gradient accumulation, zero.Init, optimizer offload,
checkpoints (saved with ZeRO++ and loaded without it, the reverse, and resharded to another world size),
hpZ's memory in the engine's accounting, fp16 overflow through qgZ, and frozen weights stored as int8.
4 Gloo ranks as 2 nodes x 2, then 2 ranks as 2 nodes x 1 for the resharding load.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from shardspeed.core.memory import estimate
from shardspeed.zero.zeropp.quantize import BlockLayout, dequantize, quantize

from common import base_config, build_model, train_engine
from harness import run_ranks
from models import token_batches

ALL = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
STEPS = 4
TOLERANCE = (
    0.03  # relative loss gap to the same run without ZeRO++ (qgZ's int4 dominates; see test_zeropp.py)
)
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
LINEAR = 64 * 64 + 64


def _config(switches: dict, gas: int = 1, **extra) -> dict:
    extra = copy.deepcopy(extra)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 3000, **switches,
            **extra.pop("zero_optimization", {})}  # fmt: skip
    return base_config(gradient_accumulation_steps=gas, zero_optimization=zero, **extra)


def _engine(config: dict, seed: int = 0, frozen: bool = False, init: dict | None = None):
    import shardspeed

    torch.manual_seed(seed)
    if init is not None:  # built partitioned, as DeepSpeed's zero.Init does
        with shardspeed.zero.Init(config_dict_or_path=config, **init):
            model = build_model(frozen)
    else:
        model = build_model(frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = shardspeed.initialize(model=model, model_parameters=trainable, config=copy.deepcopy(config))
    return engine


def _train(engine, steps: range, world: int) -> list[float]:
    import torch.distributed as dist

    data = token_batches(steps.stop, engine.train_batch_size())
    return train_engine(engine, data, steps, dist.get_rank(), world)


def _state(engine) -> dict:
    """Every trainable parameter's fp32 master and Adam moment, and the frozen parameter (collective)."""
    from shardspeed.zero import GatheredParameters, safe_get_full_fp32_param, safe_get_full_optimizer_state

    named = list(engine.module.named_parameters())
    with GatheredParameters([p for _, p in named]):
        frozen = {n: p.detach().clone() for n, p in named if not p.requires_grad}
    return {
        "masters": {n: safe_get_full_fp32_param(p) for n, p in named if p.requires_grad},
        "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named if p.requires_grad},
        "frozen": frozen,
    }


def _compare_runs(world: int, switches: dict, gas: int, extra: dict, init=None) -> dict:
    """The same job with and without `switches`: per-step losses of both."""
    out = {}
    for name, chosen in (("plain", {}), ("zeropp", switches)):
        engine = _engine(_config(chosen, gas, **extra), init=init)
        out[name] = _train(engine, range(STEPS), world)
        engine.destroy()
    return out


def _init_switch() -> dict:
    """zero.Init(zero_quantized_weights=True) turns qwZ on like the config key: the same run, bit for bit."""
    out = {}
    for name, init, switches in (("init", {"zero_quantized_weights": True}, {}),
                                 ("config", {}, {"zero_quantized_weights": True})):  # fmt: skip
        engine = _engine(_config(switches), init=init)
        out[name] = (engine.zeropp is not None and engine.zeropp.weights.quantize_weights,
                     _train(engine, range(STEPS), 4))  # fmt: skip
        engine.destroy()
    return out


def _hpz_memory() -> dict:
    """hpZ's secondary shards in the engine's memory accounting: held between backward and the step."""
    import shardspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **ALL}}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, config=config)
    seen = {}
    for step in range(2):
        engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean())
        seen[f"before step {step}"] = engine.memory_breakdown()["secondary_params"]
        engine.step()
        seen[f"after step {step}"] = engine.memory_breakdown()["secondary_params"]
    engine.destroy()
    return seen


def _overflow_through_qgz() -> dict:
    """An inf gradient on one rank of the other node reaches every rank through the int4 all-to-alls."""
    import torch.distributed as dist

    engine = _engine(_config(ALL, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}))
    data = token_batches(1, engine.train_batch_size())
    loss = engine(data[0, dist.get_rank() * 2 : dist.get_rank() * 2 + 2])
    engine.backward(loss * (float("inf") if dist.get_rank() == 3 else 1.0))
    scale = engine.loss_scale()
    engine.step()
    result = {"skipped": engine.skipped_steps, "scale": (scale, engine.loss_scale())}
    engine.destroy()
    return result


def _checkpoints(root: str) -> dict:
    """Saved with ZeRO++, loaded without it; saved without, loaded with; the frozen weight stored as int8."""
    out = {}
    plan = [("zeropp", {**ALL, "zero_quantized_nontrainable_weights": True}, "plain", {}),
            ("plain", {}, "zeropp", ALL)]  # fmt: skip
    for saved_as, saving, loaded_as, loading in plan:
        engine = _engine(_config(saving), frozen=True)
        _train(engine, range(2), 4)
        engine.save_checkpoint(f"{root}/{saved_as}")
        saved = _state(engine)
        engine.destroy()
        engine = _engine(_config(loading), seed=7, frozen=True)  # other initial values: all must load
        engine.load_checkpoint(f"{root}/{saved_as}")
        out[f"{saved_as} -> {loaded_as}"] = {"saved": saved, "loaded": _state(engine)}
        out[f"{saved_as} -> {loaded_as}"]["losses"] = _train(engine, range(2, STEPS), 4)
        engine.destroy()
    return out


def _frozen_int8() -> dict:
    """zero_quantized_nontrainable_weights: the frozen parameter is stored as int8 blocks of its shards."""
    from shardspeed.zero import GatheredParameters

    torch.manual_seed(0)
    original = build_model(frozen=True).pos.detach().clone()
    engine = _engine(_config({"zero_quantized_nontrainable_weights": True}), frozen=True)
    bytes_ = engine.memory_breakdown()["params"]
    with GatheredParameters([engine.module.pos]):
        gathered = engine.module.pos.detach().clone()
    engine.destroy()
    plain = _engine(_config({}), frozen=True)
    plain_bytes = plain.memory_breakdown()["params"]
    plain.destroy()
    return {"original": original, "gathered": gathered, "bytes": bytes_, "plain_bytes": plain_bytes}


def _four_ranks(root: str) -> dict:
    os.environ["SHARDSPEED_RANKS_PER_NODE"] = "2"
    return {
        "fp16, 2 micro-steps, zero.Init, CPU optimizer offload": _compare_runs(
            4, ALL, 2, {**FP16, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, init={}
        ),
        "bf16": _compare_runs(4, ALL, 1, {"bf16": {"enabled": True}}),
        "zero.Init switch": _init_switch(),
        "memory": _hpz_memory(),
        "overflow": _overflow_through_qgz(),
        "checkpoints": _checkpoints(root),
        "frozen int8": _frozen_int8(),
    }


def _two_ranks(root: str) -> dict:
    """The 4-rank ZeRO++ checkpoint resharded onto 2 ranks as 2 nodes x 1 (qgZ with one rank per node)."""
    os.environ["SHARDSPEED_RANKS_PER_NODE"] = "1"
    out = {}
    for name, switches in (("plain", {}), ("qwZ+qgZ", {"zero_quantized_weights": True,
                                                      "zero_quantized_gradients": True})):  # fmt: skip
        engine = _engine(_config(switches, gas=2), seed=7, frozen=True)
        engine.load_checkpoint(f"{root}/zeropp")
        out[name] = {"loaded": _state(engine), "losses": _train(engine, range(2, STEPS), 2)}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zeropp"))
    four = run_ranks(_four_ranks, 4, root, timeout=600)
    two = run_ranks(_two_ranks, 2, root, timeout=300)
    return four, two


def _within(losses: list[float], reference: list[float]) -> bool:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < TOLERANCE and losses != reference


@pytest.mark.parametrize("case", ["fp16, 2 micro-steps, zero.Init, CPU optimizer offload", "bf16"])
def test_training_with_zeropp_stays_within_tolerance(runs, case):
    for rank in runs[0]:
        result = rank[case]
        assert _within(result["zeropp"], result["plain"]), result


def test_zero_init_switch_turns_on_qwz_like_the_config_key(runs):
    for rank in runs[0]:
        result = rank["zero.Init switch"]
        assert result["init"] == result["config"] and result["init"][0] is True


def test_hpz_secondary_shards_show_in_the_memory_accounting(runs):
    psi = 3 * LINEAR  # every unit is released after its backward and keeps a secondary shard until the step
    expected = estimate(psi, 4, 3, "bf16", hpz_partition_size=2).secondary_params
    for rank in runs[0]:
        memory = rank["memory"]
        assert memory["before step 0"] == memory["before step 1"] == expected == 2 * psi // 2, memory
        assert memory["after step 0"] == memory["after step 1"] == 0, memory


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_through_qgz(runs):
    for rank in runs[0]:
        assert rank["overflow"]["skipped"] == 1
        before, after = rank["overflow"]["scale"]
        assert after == before / 2


def _assert_same_state(saved: dict, loaded: dict) -> None:
    for kind in ("masters", "exp_avg", "frozen"):
        assert saved[kind].keys() == loaded[kind].keys()
        for name in saved[kind]:
            assert torch.equal(saved[kind][name], loaded[kind][name]), (kind, name)


def test_checkpoints_cross_load_with_and_without_zeropp(runs):
    for rank in runs[0]:
        for case in ("zeropp -> plain", "plain -> zeropp"):
            result = rank["checkpoints"][case]
            _assert_same_state(result["saved"], result["loaded"])
            assert all(torch.isfinite(torch.tensor(result["losses"])))


def test_zeropp_checkpoint_reshards_onto_two_ranks(runs):
    saved = runs[0][0]["checkpoints"]["zeropp -> plain"]["saved"]
    for rank in runs[1]:
        for name in ("plain", "qwZ+qgZ"):
            _assert_same_state(saved, rank[name]["loaded"])
        assert _within(rank["qwZ+qgZ"]["losses"], rank["plain"]["losses"])


def test_frozen_weights_are_stored_as_int8_blocks_of_each_shard(runs):
    for rank in runs[0]:
        frozen = rank["frozen int8"]
        original = frozen["original"].reshape(4, -1)  # four equal shards (512 elements, no padding)
        layout = BlockLayout([[128]] * 4, bits=8)  # the unit holds this one parameter: a block per shard
        expected = dequantize(quantize(original, layout, range(4)), layout, range(4)).view_as(
            frozen["original"]
        )
        assert torch.equal(frozen["gathered"], expected)
        assert not torch.equal(expected, frozen["original"])
        saved = 4 * 128 - (128 + 4)  # this rank's fp32 shard -> its int8 record (values and one scale)
        assert frozen["plain_bytes"] - frozen["bytes"] == saved
