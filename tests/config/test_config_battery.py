"""Malformed input battery: bad configs passed to `initialize` are refused before anything is built.

Each case goes through `shardspeed.initialize` the way a user's script would, with no process group yet;
it must raise a ConfigError whose message names the key path (or the file) and what is wrong, and leave no
trace: no process group initialised, no environment variable set, no file or folder written. (Cases that
only `load_config` sees are in test_config_errors.py; this battery does not repeat them.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import shardspeed
from shardspeed.config import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 2}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}
# What initialising a process group writes back into the environment.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
NVME = "nvme-swap"  # relative: it would appear in the test's working folder if anything created it


def cfg(**extra) -> dict:
    return {**BASE, **extra}


def opt(**params) -> dict:
    return {"type": "AdamW", "params": {"lr": 1e-3, **params}}


def sched(type_name: str, **params) -> dict:
    return {"optimizer": ADAMW, "scheduler": {"type": type_name, "params": params}}


@dataclass
class Text:
    """A config given as a file with this content (bytes for non-text)."""

    content: str | bytes


@dataclass
class Path_:
    """A config given as a path: "dir" (an existing folder) or "missing" (no such file)."""

    kind: str


# (id, config, key path or file that must be named, fragment saying what is wrong, data-parallel world size)
CASES = [
    # -- misspelt keys, at every nesting level ----------------------------------------------------------
    ("typo top level", {"train_batch_sise": 8}, "train_batch_sise", "did you mean 'train_batch_size'", 1),
    ("typo level 2", cfg(zero_optimization={"stage": 2, "overlap_com": True}), "zero_optimization.overlap_com",
     "did you mean 'zero_optimization.overlap_comm'", 1),
    ("typo level 3 offload_optimizer", cfg(zero_optimization={"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_pth": NVME}}), "zero_optimization.offload_optimizer.nvme_pth",
     "did you mean 'zero_optimization.offload_optimizer.nvme_path'", 1),
    ("typo level 3 offload_param", cfg(zero_optimization={"stage": 3, "offload_param": {
        "device": "cpu", "buffer_cout": 4}}), "zero_optimization.offload_param.buffer_cout", "buffer_count", 1),
    ("typo optimizer param", cfg(optimizer=opt(weight_decy=0.1)), "optimizer.params.weight_decy",
     "did you mean 'weight_decay'", 1),
    ("typo scheduler param", cfg(**sched("WarmupLR", warmup_num_step=10)), "scheduler.params.warmup_num_step",
     "did you mean 'warmup_num_steps'", 1),
    ("typo bf16", cfg(bf16={"enable": True}), "bf16.enable", "bf16.enabled", 1),
    ("typo level 3 checkpoint", cfg(checkpoint={"parallel_write": {"pipline_stage": True}}),
     "checkpoint.parallel_write.pipline_stage", "checkpoint.parallel_write.pipeline_stage", 1),
    ("typo activation_checkpointing", cfg(activation_checkpointing={"partition_activation": True}),
     "activation_checkpointing.partition_activation", "partition_activations", 1),
    ("typo flops_profiler", cfg(flops_profiler={"enabeld": True}), "flops_profiler.enabeld",
     "flops_profiler.enabled", 1),
    ("typo wandb", cfg(wandb={"enabled": True, "projct": "x"}), "wandb.projct", "wandb.project", 1),
    ("typo aio", cfg(aio={"block_sise": 1048576}), "aio.block_sise", "aio.block_size", 1),
    ("typo csv_monitor", cfg(csv_monitor={"enabled": True, "job_nam": "x"}), "csv_monitor.job_nam",
     "csv_monitor.job_name", 1),
    # -- wrong types ----------------------------------------------------------------------------------------
    ("block as string", cfg(zero_optimization="stage 2"), "zero_optimization", "expected an object", 1),
    ("optimizer as string", cfg(optimizer="Adam"), "optimizer", "expected an object", 1),
    ("lr quoted", cfg(optimizer=opt(lr="0.001")), "optimizer.params.lr", "got the string '0.001'", 1),
    ("betas scalar", cfg(optimizer=opt(betas=0.9)), "optimizer.params.betas", "list of two numbers", 1),
    ("warmup steps float", cfg(**sched("WarmupLR", warmup_num_steps=1.5)), "scheduler.params.warmup_num_steps",
     "expected an integer, got 1.5", 1),
    ("scale power quoted", cfg(fp16={"enabled": True, "initial_scale_power": "16"}), "fp16.initial_scale_power",
     "without quotes", 1),
    ("bool quoted", cfg(zero_optimization={"stage": 2, "overlap_comm": "true"}), "zero_optimization.overlap_comm",
     "boolean", 1),
    ("bool as word", cfg(wall_clock_breakdown="no"), "wall_clock_breakdown", "boolean", 1),
    ("integer as list", cfg(gradient_accumulation_steps=[2]), "gradient_accumulation_steps",
     "expected an integer, got [2]", 1),
    ("fractional size", cfg(zero_optimization={"stage": 2, "reduce_bucket_size": 5.5}),
     "zero_optimization.reduce_bucket_size", "expected an integer, got 5.5", 1),
    ("path as number", cfg(tensorboard={"enabled": True, "output_path": 3}), "tensorboard.output_path",
     "expected a string", 1),
    ("nvme_path as number", cfg(zero_optimization={"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": 5}}), "zero_optimization.offload_optimizer.nvme_path", "expected a string", 1),
    # -- the batch triple, at the world size the launcher announces ---------------------------------------
    ("batch triple at world 2", {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 2}, "train_batch_size (8)", "world size (2)", 2),
    ("batch not divisible by world 4", {"train_batch_size": 6}, "train_batch_size", "4", 4),
    # -- unknown optimizer / scheduler, and their values ------------------------------------------------------
    ("optimizer misspelt", cfg(optimizer={"type": "Adamm", "params": {"lr": 1e-3}}), "optimizer.type",
     "did you mean 'Adam'", 1),
    ("optimizer unknown", cfg(optimizer={"type": "SuperOptimizer", "params": {}}), "optimizer.type",
     "unknown optimizer 'SuperOptimizer'", 1),
    ("scheduler misspelt", cfg(**sched("WarmupLRR")), "scheduler.type", "did you mean 'WarmupLR'", 1),
    ("scheduler unknown", cfg(**sched("CosineAnnealing")), "scheduler.type", "did you mean 'CosineAnnealingLR'", 1),
    ("scheduler without optimizer", cfg(scheduler={"type": "WarmupLR", "params": {}}), "scheduler",
     "needs an optimizer", 1),
    ("scheduler missing argument", cfg(**sched("WarmupDecayLR", warmup_num_steps=10)),
     "scheduler.params.total_num_steps", "required by WarmupDecayLR", 1),
    ("negative lr", cfg(optimizer=opt(lr=-1e-3)), "optimizer.params.lr", "non-negative", 1),
    ("beta out of range", cfg(optimizer=opt(betas=[1.5, 0.9])), "optimizer.params.betas", "[0, 1)", 1),
    ("torch optimizer refuses", cfg(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": -1}}),
     "optimizer.params", "Invalid momentum value: -1", 1),
    ("negative warmup", cfg(**sched("WarmupLR", warmup_num_steps=-5)), "scheduler.params.warmup_num_steps",
     "must be >= 0", 1),
    # -- NVMe offload, precision, sizes -------------------------------------------------------------------
    ("nvme optimizer offload without path", cfg(zero_optimization={"stage": 3, "offload_optimizer": {
        "device": "nvme"}}), "zero_optimization.offload_optimizer.nvme_path", "required when", 1),
    ("nvme path empty", cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": ""}}),
     "zero_optimization.offload_optimizer.nvme_path", "required when", 1),
    ("negative live parameters", cfg(zero_optimization={"stage": 3, "stage3_max_live_parameters": -1}),
     "zero_optimization.stage3_max_live_parameters", "must be >= 0", 1),
    ("zero sub_group_size", cfg(zero_optimization={"stage": 3, "sub_group_size": 0}),
     "zero_optimization.sub_group_size", "must be > 0", 1),
    ("negative persistence threshold", cfg(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": -1}),
     "zero_optimization.stage3_param_persistence_threshold", "must be >= 0", 1),
    ("zero loss_scale_window", cfg(fp16={"enabled": True, "loss_scale_window": 0}), "fp16.loss_scale_window",
     "must be > 0", 1),
    ("zero min_loss_scale", cfg(fp16={"enabled": True, "min_loss_scale": 0}), "fp16.min_loss_scale",
     "must be > 0", 1),
    ("negative aio queue depth", cfg(aio={"queue_depth": -1}), "aio.queue_depth", "must be > 0", 1),
    # -- config text and paths ----------------------------------------------------------------------------
    ("empty file", Text(""), "ds.json", "is empty", 1),
    ("blank file", Text("  \n\t\n"), "ds.json", "is empty", 1),
    ("comments only", Text("// a config to fill in\n# later\n"), "ds.json", "only comments", 1),
    ("unclosed JSON", Text('{"train_micro_batch_size_per_gpu": 2'), "ds.json", "invalid JSON", 1),
    ("trailing garbage", Text('{"train_micro_batch_size_per_gpu": 2} xyz'), "ds.json", "Extra data", 1),
    ("two objects", Text('{"train_micro_batch_size_per_gpu": 2}\n{"gradient_clipping": 1}'), "ds.json",
     "line 2, column 1: Extra data", 1),
    ("HJSON extra brace", Text("train_micro_batch_size_per_gpu: 2\n}\n"), "ds.json", "line 2", 1),
    ("HJSON unclosed", Text("{\n  # micro batch\n  train_micro_batch_size_per_gpu: 2\n"), "ds.json",
     "invalid JSON", 1),
    ("HJSON fp16 with bf16", Text("{\n train_micro_batch_size_per_gpu: 2\n fp16: {enabled: true}\n"
                                  " bf16: {enabled: true}\n}\n"), "bf16.enabled", "fp16.enabled", 1),
    ("not UTF-8", Text(b"\xff\xfe{}"), "ds.json", "not UTF-8", 1),
    ("a folder as config", Path_("dir"), "a-folder", "is a directory", 1),
    ("a missing file", Path_("missing"), "no-such.json", "not found", 1),
]  # fmt: skip


@pytest.fixture
def bare_process(tmp_path, monkeypatch):
    """A process as a user's script starts: no process group, working in an empty folder."""
    monkeypatch.chdir(tmp_path)
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    yield tmp_path
    if dist.is_initialized():  # a case that got that far must not spoil the others
        dist.destroy_process_group()


def _source(config, folder):
    if isinstance(config, Text):
        path = folder / "ds.json"
        path.write_bytes(config.content if isinstance(config.content, bytes) else config.content.encode())
        return str(path)
    if isinstance(config, Path_):
        if config.kind == "dir":
            (folder / "a-folder").mkdir()
            return str(folder / "a-folder")
        return str(folder / "no-such.json")
    return config


@pytest.mark.parametrize(
    ("config", "key", "fragment", "world"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_config_is_refused_before_anything_is_built(
    bare_process, monkeypatch, config, key, fragment, world
):
    if world > 1:  # as a launcher would announce it; rank 0 of `world`
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    source = _source(config, bare_process)
    before = sorted(p.name for p in bare_process.iterdir())
    environ = {k: os.environ.get(k) for k in LAUNCH_ENV}
    with pytest.raises(ConfigError) as caught:
        shardspeed.initialize(model=torch.nn.Linear(4, 4), config=source)
    message = str(caught.value)
    assert key in message and fragment in message, message
    assert not dist.is_initialized(), "a process group was initialised before the config was refused"
    assert {k: os.environ.get(k) for k in LAUNCH_ENV} == environ, "the launch environment was written"
    assert sorted(p.name for p in bare_process.iterdir()) == before, "something was written"


def test_battery_size_and_no_duplicates():
    from test_config_errors import MALFORMED

    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)
    known = [m[0] for m in MALFORMED]
    assert not [c for c in CASES if isinstance(c[1], dict) and c[1] in known]
