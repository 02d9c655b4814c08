"""Consolidation (zero_to_fp32): a checkpoint of any stage becomes the reference model's full fp32 state
dict — tied aliases and buffers included — in memory, as safetensors (one file or sharded with an index),
through the CLI, and without a process group. Broken checkpoints are refused naming the file.

One world-2 spawn saves every checkpoint; everything else runs in this (non-distributed) process.
"""

import copy
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from shardspeed.checkpoint import CheckpointError
from shardspeed.checkpoint.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardspeed.checkpoint.universal import CheckpointReader

from common import base_config, build_model, param_groups, reference_run, train_engine
from harness import run_ranks
from models import token_batches

WORLD, STEPS = 2, 3
OPTIONS = {"frozen": True, "groups": True}
CASES = {  # label: (stage, precision overrides, save with exclude_frozen_parameters)
    "s3": (3, {}, False),
    "s2-bf16": (2, {"bf16": {"enabled": True}}, False),
    "s0-fp16": (0, {"fp16": {"enabled": True, "initial_scale_power": 8}}, False),
    "s1-no-frozen": (1, {}, True),
}


def _model():
    """TinyGPT (tied embeddings, frozen `pos`) with a persistent float buffer, an integer one and a
    non-persistent one (which must not appear in the output)."""
    model = build_model(OPTIONS["frozen"])
    model.register_buffer("counts", torch.arange(5, dtype=torch.int64))
    model.blocks[0].register_buffer("scale", torch.full((4,), 0.5))
    model.register_buffer("cache", torch.zeros(3), persistent=False)
    return model


def _save_all(root: str) -> dict:
    import torch.distributed as dist

    import shardspeed
    from shardspeed.zero import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for label, (stage, extra, exclude) in CASES.items():
        zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}
        config = base_config(zero_optimization=zero, **extra)
        torch.manual_seed(0)
        model = _model()
        engine, *_ = shardspeed.initialize(
            model=model, model_parameters=param_groups(model, True), config=copy.deepcopy(config)
        )
        train_engine(
            engine, token_batches(STEPS, engine.train_batch_size()), range(STEPS), dist.get_rank(), WORLD
        )
        engine.save_checkpoint(f"{root}/{label}", exclude_frozen_parameters=exclude)
        trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        out[label] = {
            "masters": {n: safe_get_full_fp32_param(p) for n, p in trainable},
            "exp_avg_sq": {n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in trainable},
        }
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("consolidate")
    ranks = run_ranks(_save_all, WORLD, str(root), timeout=300)
    return root, ranks[0]


def _expected_state_dict() -> dict:
    """The single-process reference model's state dict after the same training."""
    reference = reference_run(STEPS, WORLD, options=OPTIONS)
    model = _model()
    model.load_state_dict(reference, strict=False)
    return model.state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b) or set(a) == set(b), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_consolidated_state_dict_equals_reference(saved, tmp_path):
    root, _ = saved
    expected = _expected_state_dict()
    state = get_fp32_state_dict_from_zero_checkpoint(root / "s3")
    assert set(state) == set(expected) and "head.weight" in state and "counts" in state
    assert "cache" not in state
    assert all(v.dtype == torch.float32 for k, v in state.items() if k != "counts")
    assert state["counts"].dtype == torch.int64
    diff = _max_diff(state, expected)
    print(f"stage 3 consolidated vs reference: max diff {diff:.2e}")
    assert diff <= 1e-5
    assert torch.equal(state["pos"], expected["pos"])

    # DeepSpeed's default output: one pytorch_model.bin
    files = convert_zero_checkpoint_to_fp32_state_dict(root / "s3", tmp_path / "bin")
    assert [f.name for f in files] == ["pytorch_model.bin"]
    written = torch.load(files[0], weights_only=True)
    assert set(written) == set(state) and all(torch.equal(written[k], state[k]) for k in state)
    assert (
        written["head.weight"] is written["tok.weight"]
    )  # the tie kept: one tensor, as in DeepSpeed's output
    files = convert_zero_checkpoint_to_fp32_state_dict(root / "s3", tmp_path / "out", safe_serialization=True)
    assert [f.name for f in files] == ["model.safetensors"]
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert set(written) == set(state) and all(torch.equal(written[k], state[k]) for k in state)
    model = _model()
    model.load_state_dict(written, strict=True)  # every key, tied alias as a copy
    assert torch.equal(model.head.weight, state["tok.weight"])

    model = load_state_dict_from_zero_checkpoint(_model(), root / "s3", tag="global_step3")
    assert torch.equal(model.blocks[1].mlp[0].weight, state["blocks.1.mlp.0.weight"])


def test_sharded_output_with_index(saved, tmp_path):
    root, _ = saved
    state = get_fp32_state_dict_from_zero_checkpoint(root / "s3")
    files = convert_zero_checkpoint_to_fp32_state_dict(
        root / "s3", tmp_path / "st", max_shard_size="16KB", safe_serialization=True
    )
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert [f.name for f in files] == [*shards, "model.safetensors.index.json"]
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    merged = {}
    for name in shards:
        part = load_file(tmp_path / "st" / name)
        big = max(t.numel() * t.element_size() for t in part.values())
        assert (
            len(part) == 1
            or sum(t.numel() * t.element_size() for t in part.values()) <= 16_000
            or big > 16_000
        )
        assert all(index["weight_map"][k] == name for k in part)
        merged.update(part)
    assert set(merged) == set(state) and all(torch.equal(merged[k], state[k]) for k in state)

    # pytorch_model.bin flavour (DeepSpeed's default), sharded the same way.
    convert_zero_checkpoint_to_fp32_state_dict(root / "s3", tmp_path / "bin", max_shard_size="40KB")
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    merged = {}
    for name in sorted({*index["weight_map"].values()}):
        merged.update(torch.load(tmp_path / "bin" / name, weights_only=True))
    assert set(merged) == set(state) and all(torch.equal(merged[k], state[k]) for k in state)


def test_mixed_precision_masters_and_optimizer_state_exact(saved):
    root, ranks = saved
    for label in ("s2-bf16", "s0-fp16"):
        state = get_fp32_state_dict_from_zero_checkpoint(root / label)
        masters = ranks[label]["masters"]
        assert all(torch.equal(state[n], masters[n]) for n in masters), label
        assert state["blocks.0.scale"].dtype == torch.float32 and torch.all(state["blocks.0.scale"] == 0.5)
        reader = CheckpointReader(root / label)
        for name, expected in ranks[label]["exp_avg_sq"].items():
            got = reader.optimizer_state(name)
            assert torch.equal(got["exp_avg_sq"], expected.view(reader.shape(name))), (label, name)
            assert float(got["step"]) == STEPS
        assert reader.param_group_of("blocks.0.ln1.bias") == 1 and reader.param_group_of("pos") is None


def test_excluded_frozen_parameters(saved):
    root, _ = saved
    full = get_fp32_state_dict_from_zero_checkpoint(root / "s3")
    without = get_fp32_state_dict_from_zero_checkpoint(root / "s3", exclude_frozen_parameters=True)
    assert set(full) - set(without) == {"pos"}
    saved_without = get_fp32_state_dict_from_zero_checkpoint(root / "s1-no-frozen")  # excluded at save time
    assert set(saved_without) == set(without)


def _convert_into_one_folder(source: str, output: str) -> list[str]:
    for _ in range(3):  # several rounds, so that the ranks' writes overlap
        files = convert_zero_checkpoint_to_fp32_state_dict(source, output)
    return [f.name for f in files]


def test_ranks_converting_into_one_folder(saved, tmp_path):
    """Every rank of a job converting into the same folder (DeepSpeed's test does so) each finish whole."""
    root, _ = saved
    names = run_ranks(_convert_into_one_folder, WORLD, str(root / "s3"), str(tmp_path / "both"), timeout=120)
    assert names == [["pytorch_model.bin"]] * WORLD
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == ["pytorch_model.bin"]  # no temporary left
    written = torch.load(tmp_path / "both" / "pytorch_model.bin", weights_only=True)
    expected = get_fp32_state_dict_from_zero_checkpoint(root / "s3")
    assert set(written) == set(expected) and all(torch.equal(written[k], expected[k]) for k in expected)


def test_cli(saved, tmp_path):
    root, _ = saved
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "shardspeed.checkpoint.consolidate", str(root / "s2-bf16"), str(out)]
    done = subprocess.run(
        [*cmd, "--max_shard_size", "30KB", "-t", "global_step3", "--safe_serialization"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    merged = {}
    for name in {*index["weight_map"].values()}:
        merged.update(load_file(out / name))
    expected = get_fp32_state_dict_from_zero_checkpoint(root / "s2-bf16")
    assert set(merged) == set(expected) and all(torch.equal(merged[k], expected[k]) for k in expected)

    failed = subprocess.run([*cmd[:-2], str(tmp_path / "nowhere"), str(out)], capture_output=True, text=True)
    assert failed.returncode == 1 and "nowhere" in failed.stderr and "Traceback" not in failed.stderr


def test_recovery_script_beside_zero_checkpoints(saved, tmp_path, monkeypatch):
    """As DeepSpeed: a ZeRO (stage >= 1) save leaves an executable zero_to_fp32.py beside its tags, which
    consolidates the checkpoint when run from there; a stage 0 save does not."""
    from shardspeed.checkpoint.recovery_script import make_executable
    from shardspeed.runtime.engine_checkpoint_files import CheckpointFiles
    from shardspeed.utils.logging import logger

    root, _ = saved
    for label, (stage, _, _) in CASES.items():
        assert (root / label / "zero_to_fp32.py").is_file() == (stage > 0), label
    script = root / "s3" / "zero_to_fp32.py"
    assert os.stat(script).st_mode & stat.S_IXUSR
    done = subprocess.run(
        [sys.executable, script.name, ".", str(tmp_path / "out")],
        cwd=script.parent,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    written = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = get_fp32_state_dict_from_zero_checkpoint(root / "s3")
    assert set(written) == set(expected) and all(torch.equal(written[k], expected[k]) for k in expected)

    # a file system refusing the permission change (or a script gone) is logged, not raised
    logged = []
    monkeypatch.setattr(logger, "info", lambda message, *a, **k: logged.append(message))
    make_executable(tmp_path / "gone" / "zero_to_fp32.py")
    assert len(logged) == 1 and "could not make" in logged[0] and "gone" in logged[0]

    # DeepSpeed's name of an expert-parallel rank's optimizer file (DeepSpeed's MoE layout, ZeRO stage 0)
    engine = type(
        "Engine", (CheckpointFiles,), {"_checkpoint_placement": lambda self: type("P", (), {"mp_rank": 1})}
    )
    name = engine()._get_optimizer_ckpt_name("/ckpt", 7, expp_rank=3)
    assert name == os.path.join("/ckpt", "7", "expp_rank_3_mp_rank_01_optim_states.pt")


def test_broken_checkpoints_name_the_file(saved, tmp_path):
    root, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(root / "s3", broken)
    tag = broken / "global_step3"
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"

    # A rank's partition is missing.
    moved = rank1.rename(tag / "elsewhere.pt")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\].*zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        CheckpointReader(broken)
    moved.rename(rank1)

    # A partition whose layout disagrees with rank 0's.
    partition = torch.load(rank1, weights_only=True)
    partition["optimizer_state_dict"]["buckets"][0]["names"].reverse()
    torch.save(partition, tag / "swapped.pt")
    original = rank1.read_bytes()
    (tag / "swapped.pt").rename(rank1)
    with pytest.raises(CheckpointError, match=r"inconsistent.*zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        get_fp32_state_dict_from_zero_checkpoint(broken)

    # A corrupt partition.
    rank1.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt is truncated"):
        get_fp32_state_dict_from_zero_checkpoint(broken)

    # No `latest` and no tag.
    (broken / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"latest.*global_step3"):
        CheckpointReader(broken)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nowhere")
