"""Resharding: a checkpoint saved at world size N and ZeRO stage S loads at world M and stage S' and training
continues exactly as an uninterrupted run would have.

Every run uses the same global batch (8 samples: micro-batch 2, accumulation 8 / (2 * world)), so a run that
changes world size mid-way sees the same data as the single-process reference. The spawns run in an order
that lets each load the checkpoints the previous ones saved: world 1, 2, 4, then 2 again (4 -> 2).
"""

import copy

import pytest
import torch

from common import (
    base_config,
    build_model,
    full_params,
    max_diff,
    param_groups,
    reference_run,
    train_engine,
    warmup_lr,
)
from harness import run_ranks
from models import token_batches

GLOBAL_BATCH, SAVE_AT, STEPS = 8, 3, 6
OPTIONS = {"frozen": True, "groups": True}  # a frozen parameter, two groups, tied weights (TinyGPT)
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}

# (label, stage, precision overrides) of the checkpoints each world size saves at step SAVE_AT.
SAVES = {
    1: [("w1-s0", 0, {})],
    2: [("w2-s3", 3, {}), ("w2-s1", 1, {}), ("w2-s1-fp16", 1, FP16)],
    4: [("w4-s2", 2, {})],
}
# (label, checkpoint to load, stage, precision overrides) of the resumed runs at each world size.
LOADS = {
    2: [("1/s0 -> 2/s3", "w1-s0", 3, {}), ("2/s1 -> 2/s2", "w2-s1", 2, {})],
    4: [("2/s3 -> 4/s1", "w2-s3", 1, {}), ("2/s1 fp16 -> 4/s3 fp16", "w2-s1-fp16", 3, FP16)],
    "2 again": [
        ("4/s2 -> 2/s0", "w4-s2", 0, {}),
        ("4/s2 -> 2/s3 bucket 500", "w4-s2", 3, {"bucket": 500}),
        ("2/s1 -> 2/s1 bucket 500", "w2-s1", 1, {"bucket": 500}),  # same world and stage, new layout
    ],
}


def _config(world: int, stage: int, extra: dict) -> dict:
    extra = dict(extra)
    bucket = extra.pop("bucket", 3000)
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=100, stage3_prefetch_bucket_size=bucket)
    return base_config(
        gradient_accumulation_steps=GLOBAL_BATCH // (2 * world), zero_optimization=zero, **extra
    )


def _engine(config: dict, seed: int):
    import shardspeed

    torch.manual_seed(seed)
    model = build_model(OPTIONS["frozen"])
    model.register_buffer("calib", torch.randn(5))  # seed-dependent: the checkpoint's must be loaded
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=param_groups(model, OPTIONS["groups"]), config=copy.deepcopy(config)
    )
    return engine


def _masters(engine) -> dict:
    """Every trainable parameter's full fp32 master (collective at stages 1-3)."""
    from shardspeed.zero import safe_get_full_fp32_param

    return {
        n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad
    }


def _save_and_load(root: str, world: int, phase) -> dict:
    import torch.distributed as dist

    out, data = {}, token_batches(STEPS, GLOBAL_BATCH)
    for label, stage, extra in SAVES.get(phase, []):
        engine = _engine(_config(world, stage, extra), seed=0)
        train_engine(engine, data, range(SAVE_AT), dist.get_rank(), world)
        engine.save_checkpoint(f"{root}/{label}")
        out[label] = {"masters": _masters(engine)}
        engine.destroy()
    for label, source, stage, extra in LOADS.get(phase, []):
        engine = _engine(_config(world, stage, extra), seed=123)  # other initial values: all must be loaded
        engine.load_checkpoint(f"{root}/{source}")
        loaded = {
            "masters": _masters(engine),
            "steps": engine.global_steps,
            "calib": engine.module.calib.clone(),
        }
        if extra:
            loaded["scale"] = engine.loss_scale()
        losses = train_engine(engine, data, range(SAVE_AT, STEPS), dist.get_rank(), world)
        out[label] = {**loaded, "params": full_params(engine), "losses": losses, "lr": engine.get_lr()}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    results = {}
    for phase, world in ((1, 1), (2, 2), (4, 4), ("2 again", 2)):
        ranks = run_ranks(_save_and_load, world, root, world, phase, timeout=300)
        for label in ranks[0]:
            results[label] = ranks  # every rank's view of the case
    return results


FP32_CASES = [label for loads in LOADS.values() for label, _, _, extra in loads if "fp16" not in extra]


@pytest.mark.parametrize("case", FP32_CASES)
def test_resharded_run_matches_uninterrupted_reference(runs, case):
    reference = reference_run(STEPS, world=1, micro=2, gas=GLOBAL_BATCH // 2, options=OPTIONS)
    torch.manual_seed(0)
    build_model(OPTIONS["frozen"])
    calib = torch.randn(5)
    for rank, results in enumerate(runs[case]):
        got = results[case]
        assert got["steps"] == SAVE_AT and torch.equal(got["calib"], calib)
        assert got["lr"] == [warmup_lr(STEPS)] * 2  # the scheduler continued
        diff = max_diff(got["params"], reference)
        print(f"{case} rank {rank}: max |param - reference| = {diff:.2e}")
        assert diff <= 1e-5, (case, rank, diff)
        assert torch.equal(got["params"]["pos"], reference["pos"])  # frozen: carried over exactly


def test_fp16_masters_are_resharded_exactly(runs):
    saved = runs["w2-s1-fp16"][0]["w2-s1-fp16"]["masters"]
    for results in runs["2/s1 fp16 -> 4/s3 fp16"]:
        got = results["2/s1 fp16 -> 4/s3 fp16"]
        assert got["masters"].keys() == saved.keys()
        assert all(torch.equal(got["masters"][n], saved[n]) for n in saved)
        assert got["scale"] == 2.0**8  # the loss scale carries over (no overflow in 3 steps at 2**8)
        assert all(torch.isfinite(torch.tensor(got["losses"])))


def test_fp32_masters_are_resharded_exactly(runs):
    for source, case in (("w2-s3", "2/s3 -> 4/s1"), ("w4-s2", "4/s2 -> 2/s0"), ("w1-s0", "1/s0 -> 2/s3")):
        saved = runs[source][0][source]["masters"]
        for results in runs[case]:
            got = results[case]["masters"]
            assert all(torch.equal(got[n], saved[n]) for n in saved), case
