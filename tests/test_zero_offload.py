"""Optimizer offload: NVMe keeps Adam's state in files between steps and trains exactly as without offload.

"cpu" offload on a CPU-only run places masters and state where they already are, so it must train
bit-identically to no offload; "nvme" steps bucket by bucket with the state read from and written to files,
and must too. Checkpoints saved with NVMe offload resume exactly and load into engines without it.
"""

import copy
import os

import pytest
import torch

from common import base_config, engine_run, full_params, max_diff, reference_run, train_engine
from harness import RankFailure, run_ranks
from models import TinyGPT, token_batches

STEPS = 4
OPTIONS = {"frozen": True, "groups": True}
BF16 = {"bf16": {"enabled": True}}


def _zero(stage: int, device: str | None, nvme_path: str) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 3000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
    if device is not None:
        zero["offload_optimizer"] = {"device": device, "nvme_path": nvme_path, "pin_memory": True}
    return zero


def _parity_cases(world: int, nvme_path: str) -> dict:
    import shardspeed

    results = {}
    for stage in (1, 2, 3):
        for precision, extra in (("fp32", {}), ("bf16", BF16)):
            for device in (None, "cpu", "nvme"):
                config = base_config(zero_optimization=_zero(stage, device, nvme_path), **extra)
                results[(stage, precision, device)] = engine_run(config, world, STEPS, 0, OPTIONS)
    # What an NVMe-offloaded engine keeps in memory and on disk after a step.
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(
        model=TinyGPT(), config=base_config(zero_optimization=_zero(2, "nvme", nvme_path))
    )
    data = token_batches(1, engine.train_batch_size())
    import torch.distributed as dist

    train_engine(engine, data, range(1), dist.get_rank(), world)
    shard_numel = sum(m.numel() for m in engine.optimizer.masters)
    results["nvme memory"] = {
        "resident_state": engine.memory_breakdown()["optimizer_state"],
        "disk_bytes": engine.optimizer.nvme.disk_bytes(),
        "shard_numel": shard_numel,
        "folder_exists_while_training": engine.optimizer.nvme.folder.is_dir(),
    }
    engine.destroy()
    results["nvme memory"]["folder_exists_after_destroy"] = engine.optimizer.nvme.folder.is_dir()
    return results


def test_offload_trains_exactly_like_no_offload(tmp_path):
    world = 2
    ranks = run_ranks(_parity_cases, world, world, str(tmp_path), timeout=600)
    reference = reference_run(STEPS, world, options=OPTIONS)
    for results in ranks:
        for stage in (1, 2, 3):
            for device in ("cpu", "nvme"):
                assert max_diff(results[(stage, "fp32", device)]["params"], reference) <= 1e-5
                for precision in ("fp32", "bf16"):
                    plain = results[(stage, precision, None)]["params"]
                    offloaded = results[(stage, precision, device)]["params"]
                    assert max_diff(offloaded, plain) == 0, (stage, precision, device)
        memory = results["nvme memory"]
        # Adam's exp_avg and exp_avg_sq (fp32) are on disk; only the step counters stay in memory.
        assert memory["disk_bytes"] >= 8 * memory["shard_numel"]
        assert memory["resident_state"] < 1024
        assert memory["folder_exists_while_training"] and not memory["folder_exists_after_destroy"]
    assert os.listdir(tmp_path) == []  # every rank's swap folder is gone


def _save_resume(root: str, world: int) -> dict:
    import torch.distributed as dist

    import shardspeed

    nvme = base_config(zero_optimization=_zero(2, "nvme", f"{root}/swap"), **BF16)
    plain = base_config(zero_optimization=_zero(2, None, ""), **BF16)

    def engine_for(config):
        torch.manual_seed(0)
        engine, *_ = shardspeed.initialize(model=TinyGPT(), config=copy.deepcopy(config))
        return engine

    engine = engine_for(nvme)
    data = token_batches(6, engine.train_batch_size())
    rank = dist.get_rank()
    train_engine(engine, data, range(3), rank, world)
    engine.save_checkpoint(f"{root}/ckpt")
    train_engine(engine, data, range(3, 6), rank, world)
    out = {"uninterrupted": full_params(engine)}
    engine.destroy()
    for name, config in (("nvme", nvme), ("plain", plain)):
        engine = engine_for(config)
        engine.load_checkpoint(f"{root}/ckpt")
        train_engine(engine, data, range(3, 6), rank, world)
        out[name] = full_params(engine)
        engine.destroy()
    return out


def test_nvme_offload_checkpoints_resume_exactly(tmp_path):
    for out in run_ranks(_save_resume, 2, str(tmp_path), 2, timeout=300):
        assert max_diff(out["nvme"], out["uninterrupted"]) == 0
        assert max_diff(out["plain"], out["uninterrupted"]) == 0
    assert os.listdir(tmp_path / "swap") == []


def _bad_nvme_path(path: str, world: int) -> None:
    import shardspeed

    config = base_config(zero_optimization=_zero(2, "nvme", path))
    shardspeed.initialize(model=TinyGPT(), config=config)


def test_unusable_nvme_path_is_refused_naming_the_key(tmp_path):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("keep me")
    with pytest.raises(
        RankFailure, match=r"zero_optimization\.offload_optimizer\.nvme_path: .* is not a directory"
    ):
        run_ranks(_bad_nvme_path, 1, str(not_a_folder), 1)
    assert not_a_folder.read_text() == "keep me"
