"""Pipeline checkpoints: per-layer files, bit-exact resume, and a 2 x 2 checkpoint loaded as 4 x 1, 1 x 4 and
as 2 stages x 2 virtual stages x 2 replicas (the interleaved schedule)."""

import os

import torch
from pipe_common import BASE_SEED, global_batches, layer_specs, loss_fn, replica_iterator

from harness import run_ranks

MICRO, BATCH = 2, 16
CONFIG = {
    "train_batch_size": BATCH,
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_clipping": 0.3,
    "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 3},
    },
    "steps_per_print": 1000,
}


def _engine(stages: int, zero_stage: int = 0, virtual: int = 1):
    import shardspeed
    from shardspeed.pipe import PipelineModule

    model = PipelineModule(
        layer_specs(),
        num_stages=stages,
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=BASE_SEED,
        virtual_stages=virtual,
    )
    config = dict(CONFIG, zero_optimization={"stage": zero_stage})
    engine, *_ = shardspeed.initialize(model=model, config=config)
    return engine


def _train(engine, steps: range) -> list[float]:
    grid = engine.grid
    dp, dp_rank = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    inputs, labels = global_batches(4, BATCH)
    data = replica_iterator(inputs, labels, steps, dp_rank, dp, MICRO, engine.gradient_accumulation_steps())
    return [engine.train_batch(data).item() for _ in steps]


def _params(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def checkpoint_job(save_root: str):
    import shardspeed

    shardspeed.init_distributed()
    return {stage: checkpoint_case(os.path.join(save_root, f"zero{stage}"), stage) for stage in (0, 1)}


def checkpoint_case(save_dir: str, zero_stage: int) -> dict:
    out = {}
    # 2 stages x 2 replicas: 4 steps straight, and 2 steps + save.
    engine = _engine(2, zero_stage)
    _train(engine, range(0, 2))
    engine.save_checkpoint(save_dir, tag="step2", client_state={"note": "mid"})
    _train(engine, range(2, 4))
    out["uninterrupted"] = _params(engine)
    out["files"] = sorted(os.listdir(os.path.join(save_dir, "step2")))
    engine.destroy()
    # Resume at the same layout: bit-exact.
    engine = _engine(2, zero_stage)
    _, client = engine.load_checkpoint(save_dir)
    out["client"] = client
    out["global_steps"] = engine.global_steps
    _train(engine, range(2, 4))
    out["resumed"] = _params(engine)
    engine.destroy()
    # Another pipeline / data degree: 4 stages x 1 replica, 1 stage x 4 replicas (plain data parallel), and
    # 2 stages x 2 replicas with 2 virtual stages per rank.
    for stages, virtual in ((4, 1), (1, 1), (2, 2)):
        engine = _engine(stages, zero_stage, virtual)
        engine.load_checkpoint(save_dir, tag="step2")
        name = f"{stages}" if virtual == 1 else f"{stages}v{virtual}"
        out[f"gas_{name}"] = engine.gradient_accumulation_steps()
        _train(engine, range(2, 4))
        out[f"stages_{name}"] = _params(engine)
        engine.destroy()
    # A layer file of stage 1 goes missing: every rank (stage 0's too) refuses before loading anything.
    import torch.distributed as dist

    engine = _engine(2, zero_stage)
    before = _params(engine)
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(save_dir, "step2", "layer_04-model_states.pt"))
    dist.barrier()
    try:
        engine.load_checkpoint(save_dir, tag="step2")
        out["missing_layer"] = "loaded"
    except Exception as err:
        out["missing_layer"] = f"{type(err).__name__}: {err}"
    out["untouched"] = all(torch.equal(before[n], p) for n, p in _params(engine).items())
    engine.destroy()
    return out


def _merged(results, key):
    merged = {}
    for r in results:
        merged.update(r[key])
    return merged


def _check(results):
    assert results[0]["files"] == sorted(
        [f"layer_{i:02d}-model_states.pt" for i in range(6)]
        + ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        + [f"rng_states_rank_{r}.pt" for r in range(4)]
        + [f for f in results[0]["files"] if "optim_states" in f]
    )
    for r in results:
        assert (
            r["missing_layer"].startswith("CheckpointError")
            and "layer_04-model_states.pt is missing" in (r["missing_layer"])
        ), r["missing_layer"]
        assert r["untouched"]
        assert r["client"] == {"note": "mid"}
        assert r["global_steps"] == 2
        for name, value in r["uninterrupted"].items():
            assert torch.equal(value, r["resumed"][name]), f"resume is not bit-exact for {name}"
    uninterrupted = _merged(results, "uninterrupted")
    assert results[0]["gas_4"] == 8 and results[0]["gas_1"] == 2
    for stages in ("4", "1", "2v2"):
        other = _merged(results, f"stages_{stages}")
        assert set(other) == set(uninterrupted)
        for name, value in other.items():
            diff = (value - uninterrupted[name]).abs().max().item()
            assert diff <= 1e-5, f"loaded at {stages} stages: {name} differs by {diff:.2e}"


def test_resume_and_reshard_at_zero_stage_0_and_1(tmp_path):
    results = run_ranks(checkpoint_job, 4, str(tmp_path))
    _check([r[0] for r in results])
    zero1 = [r[1] for r in results]
    assert "zero_pp_rank_1_mp_rank_01_optim_states.pt" in zero1[0]["files"]
    _check(zero1)
