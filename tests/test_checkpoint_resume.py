"""Checkpoints: resuming continues bit-for-bit, and broken checkpoints are refused with a clear error."""

import copy

import pytest
import torch

from common import base_config, full_params, train_engine
from harness import run_ranks
from models import TinyGPT, token_batches

FP16 = {"fp16": {"enabled": True, "initial_scale_power": 10}}
VARIANTS = {
    "fp32": base_config(),
    "fp16": base_config(**FP16),
    "bf16": base_config(bf16={"enabled": True}),
    "z1-fp16": base_config(zero_optimization={"stage": 1, "reduce_bucket_size": 3000}, **FP16),
    "z2-bf16": base_config(
        zero_optimization={"stage": 2, "reduce_bucket_size": 3000}, bf16={"enabled": True}
    ),
    "z3-fp32": base_config(
        zero_optimization={"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}
    ),
    "z3-fp16": base_config(zero_optimization={"stage": 3, "reduce_bucket_size": 3000}, **FP16),
}


def _engine(config):
    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=TinyGPT(dropout=0.1), config=copy.deepcopy(config))
    return engine


def _train_and_save(save_root: str, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for name, config in VARIANTS.items():
        engine = _engine(config)
        data = token_batches(6, engine.train_batch_size())
        train_engine(engine, data, range(3), dist.get_rank(), world)
        engine.save_checkpoint(f"{save_root}/{name}", client_state={"epoch": 7, "note": "hello"})
        losses = train_engine(engine, data, range(3, 6), dist.get_rank(), world)
        out[name] = {"params": full_params(engine), "losses": losses, "scale": engine.loss_scale()}
        engine.destroy()
    return out


def _load_and_continue(save_root: str, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for name, config in VARIANTS.items():
        torch.manual_seed(123)  # a different RNG state: the checkpoint must restore the saved one
        engine = _engine(config)
        path, client_state = engine.load_checkpoint(f"{save_root}/{name}")
        data = token_batches(6, engine.train_batch_size())
        losses = train_engine(engine, data, range(3, 6), dist.get_rank(), world)
        out[name] = {
            "params": full_params(engine), "losses": losses, "scale": engine.loss_scale(),
            "path": path, "client_state": client_state, "global_steps": engine.global_steps,
        }  # fmt: skip
        engine.destroy()
    return out


def test_resume_is_bit_exact(tmp_path):
    uninterrupted = run_ranks(_train_and_save, 2, str(tmp_path), 2)
    resumed = run_ranks(_load_and_continue, 2, str(tmp_path), 2)
    for rank in range(2):
        for name in VARIANTS:
            a, b = uninterrupted[rank][name], resumed[rank][name]
            assert b["losses"] == a["losses"], name
            assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), name
            assert b["scale"] == a["scale"]
            assert b["global_steps"] == 6
            assert b["client_state"] == {"epoch": 7, "note": "hello"}
            assert b["path"].endswith(f"{name}/global_step3")
    assert (tmp_path / "fp32" / "latest").read_text() == "global_step3"
    assert not list(tmp_path.glob("*/.*"))  # no staging leftovers


def _broken_checkpoints(root: str) -> dict:
    """Each case returns the error text (or the result) for the parent to check."""
    from pathlib import Path

    import shardspeed
    from shardspeed.checkpoint import files

    results = {}
    engine = _engine(base_config())
    engine.save_checkpoint(f"{root}/good", tag="first")
    results["missing_dir"] = engine.load_checkpoint(f"{root}/does-not-exist")
    (Path(root) / "good" / "latest").write_text("no-such-tag")
    try:
        engine.load_checkpoint(f"{root}/good")
    except shardspeed.CheckpointError as err:
        results["missing_tag"] = str(err)
    (Path(root) / "good" / "latest").write_text("first")

    # A client_state a safe load could not read is refused before anything is written.
    try:
        engine.save_checkpoint(f"{root}/good", tag="second", client_state={"fn": print})
    except TypeError as err:
        results["bad_client_state"] = str(err)
    results["latest_after_refusal"] = (Path(root) / "good" / "latest").read_text()

    # A crash in the middle of a save leaves the previous checkpoint as `latest`, and loadable.
    real_save = files.save_file

    def crash_on_rng(obj, path):
        if "rng_states" in path.name:
            raise OSError("disk full (simulated)")
        real_save(obj, path)

    files.save_file = crash_on_rng
    try:
        engine.save_checkpoint(f"{root}/good", tag="third")
    except OSError:
        results["crashed"] = True
    files.save_file = real_save
    results["latest_after_crash"] = (Path(root) / "good" / "latest").read_text()
    results["load_after_crash"] = engine.load_checkpoint(f"{root}/good")[0]

    # Corrupt file: a clear error naming the file.
    corrupt = Path(root) / "corrupt" / "t"
    corrupt.mkdir(parents=True)
    (corrupt / files.model_states_name()).write_bytes(b"not a checkpoint")
    try:
        engine.load_checkpoint(f"{root}/corrupt", tag="t")
    except shardspeed.CheckpointError as err:
        results["corrupt"] = str(err)

    # A checkpoint of a different model: the error names the parameter and both shapes.
    other, *_ = shardspeed.initialize(model=TinyGPT(dim=16), config=base_config())
    try:
        other.load_checkpoint(f"{root}/good")
    except shardspeed.CheckpointError as err:
        results["mismatch"] = str(err)
    return results


def test_broken_checkpoints_are_refused_clearly(tmp_path):
    (res,) = run_ranks(_broken_checkpoints, 1, str(tmp_path))
    assert res["missing_dir"] == (None, None)
    assert "latest names checkpoint 'no-such-tag'" in res["missing_tag"]
    assert "client_state" in res["bad_client_state"]
    assert res["latest_after_refusal"] == "first"
    assert res["crashed"] is True
    assert res["latest_after_crash"] == "first"
    assert res["load_after_crash"].endswith("first")
    assert "mp_rank_00_model_states.pt" in res["corrupt"] and "corrupt" in res["corrupt"]
    assert "'tok.weight': checkpoint (64, 32), model (64, 16)" in res["mismatch"]
    assert "'pos': checkpoint (16, 32), model (16, 16)" in res["mismatch"]
    assert not (tmp_path / "good" / "second").exists()
    assert not (tmp_path / "good" / "third").exists()


@pytest.mark.parametrize("world", [2])
def test_tag_defaults_and_latest(tmp_path, world):
    def_steps = 2
    run_ranks(_save_twice, world, str(tmp_path), def_steps)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "latest", "named"]
    assert (tmp_path / "latest").read_text() == "named"
    files = sorted(p.name for p in (tmp_path / "global_step2").iterdir())
    assert files == ["mp_rank_00_model_states.pt", "rng_states_rank_0.pt", "rng_states_rank_1.pt"]


def _save_twice(root: str, steps: int):
    import torch.distributed as dist

    engine = _engine(base_config())
    data = token_batches(steps, engine.train_batch_size())
    train_engine(engine, data, range(steps), dist.get_rank(), dist.get_world_size())
    engine.save_checkpoint(root)
    engine.save_checkpoint(root, tag="named")
    engine.save_checkpoint(root, tag="named")  # re-saving a tag replaces it


def _load_in_turns(root: str) -> dict:
    """Stage 3 with `pipeline_loading_checkpoint`: each rank notes, while it copies its partition, when each
    sub-group starts (pausing a little, so that ranks copying at the same time would interleave)."""
    import os
    import time

    import torch.distributed as dist

    import shardspeed

    shardspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = base_config(zero_optimization={"stage": 3, "pipeline_loading_checkpoint": True, "reduce_bucket_size": 3000,
                                            "stage3_param_persistence_threshold": 0})  # fmt: skip
    engine = _engine(config)
    train_engine(engine, token_batches(2, engine.train_batch_size()), range(2), rank, world)
    engine.save_checkpoint(root, tag="t")
    saved = full_params(engine)

    fresh = _engine(config)  # the initial values: the saved ones are 2 steps further
    moved = any(not torch.equal(v, full_params(fresh)[k]) for k, v in saved.items())
    log = os.path.join(root, "copies")
    copy_sub_group = fresh.optimizer._bucket_stepped

    def noted(index: int) -> None:
        with open(log, "a") as f:
            f.write(f"{rank}\n")
        time.sleep(0.02)
        copy_sub_group(index)

    fresh.optimizer._bucket_stepped = noted
    fresh.load_checkpoint(root, tag="t")
    dist.barrier()
    with open(log) as f:
        order = [int(line) for line in f]
    loaded = full_params(fresh)
    return {"order": order, "same": moved and all(torch.equal(v, loaded[k]) for k, v in saved.items())}


def test_pipeline_loading_checkpoint_copies_one_rank_after_another(tmp_path):
    from shardspeed.config import ConfigError
    from shardspeed.config.loader import load_config

    for result in run_ranks(_load_in_turns, 2, str(tmp_path)):
        assert result["same"]
        order = result["order"]
        assert len(order) > 2 and order == sorted(order), order  # all of rank 0's copies, then rank 1's
    with pytest.raises(ConfigError, match="pipeline_loading_checkpoint: true is supported only with"):
        load_config(
            {"train_batch_size": 1, "zero_optimization": {"stage": 2, "pipeline_loading_checkpoint": True}}
        )
