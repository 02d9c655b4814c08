"""ZeRO-Infinity: stage 3 parameters in host memory or files, optimizer masters and state in files.

One 2-rank job trains every offload combination at stage 3 (parameters none/cpu/nvme x optimizer
none/cpu/nvme, fp32 and bf16, NVMe reads and writes pipelined) and compares it with the run without offload:
fp32 within 1e-6 of it (and of the single-process reference), bf16 bit-identical. A second job trains a model
of tens of MB with everything on NVMe and measures what lives where: the swap files hold the model state and
the resident-set growth per rank stays far below it. Stages 1-2 with optimizer offload are in
test_zero_offload.py.
"""

import os

import pytest
import torch
from torch import nn

from common import base_config, engine_run, full_params, max_diff, micro_batch, reference_run, train_engine
from harness import run_ranks
from models import TinyGPT, token_batches

STEPS = 3
OPTIONS = {"frozen": True, "groups": True}
BF16 = {"bf16": {"enabled": True}}


def _zero3(param: str | None, optim: str | None, root: str) -> dict:
    zero = {
        "stage": 3,
        "reduce_bucket_size": 3000,
        "sub_group_size": 1500,  # several optimizer sub-groups per rank
        "stage3_param_persistence_threshold": 100,
    }
    if param:
        zero["offload_param"] = {
            "device": param, "nvme_path": f"{root}/params", "max_in_cpu": 0, "buffer_count": 2,
            "buffer_size": 2000,
        }  # fmt: skip
    if optim:
        zero["offload_optimizer"] = {
            "device": optim, "nvme_path": f"{root}/optim", "buffer_count": 3, "pipeline_read": True,
            "pipeline_write": True,
        }  # fmt: skip
    return zero


def _parity(root: str, world: int) -> dict:
    results = {}
    for precision, extra in (("fp32", {}), ("bf16", BF16)):
        for param in (None, "cpu", "nvme"):
            for optim in (None, "cpu", "nvme"):
                aio = {"aio": {"block_size": 4096, "queue_depth": 4, "single_submit": param == "cpu"}}
                config = base_config(zero_optimization=_zero3(param, optim, root), **extra, **aio)
                results[(precision, param, optim)] = engine_run(config, world, STEPS, 0, OPTIONS)
    return results


def test_every_offload_combination_trains_like_no_offload(tmp_path):
    world = 2
    ranks = run_ranks(_parity, world, str(tmp_path), world, timeout=600)
    reference = reference_run(STEPS, world, options=OPTIONS)
    for results in ranks:
        for precision in ("fp32", "bf16"):
            plain = results[(precision, None, None)]["params"]
            for param in (None, "cpu", "nvme"):
                for optim in (None, "cpu", "nvme"):
                    got = results[(precision, param, optim)]["params"]
                    if precision == "fp32":
                        assert max_diff(got, plain) <= 1e-6, (param, optim)
                        assert max_diff(got, reference) <= 1e-5, (param, optim)
                    else:
                        assert max_diff(got, plain) == 0, (param, optim)
    for sub in ("params", "optim"):  # every swap folder removed by destroy or at exit
        assert not (tmp_path / sub).exists() or os.listdir(tmp_path / sub) == []


class Stack(nn.Module):
    """Eight 1024x1024 layers (8.4M parameters, 34 MB in fp32): big enough for RSS to show the tiers."""

    def __init__(self, width: int = 1024, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.square().mean()


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _tiers(root: str, world: int) -> dict:
    import torch.distributed as dist

    import shardspeed

    sub_group = 300_000
    prefetch = 2 * 600_000
    zero = {
        "stage": 3,
        "sub_group_size": sub_group,
        "reduce_bucket_size": sub_group,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": 0, "buffer_count": 2,
                          "buffer_size": 600_000},
        "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 2, "pipeline_read": True,
                              "pipeline_write": True},
    }  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}  # fmt: skip
    # glibc would keep freed blocks above a self-raising threshold in its heap: a fixed threshold returns
    # large blocks to the system on free, so RSS shows what is really held.
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    warm, *_ = shardspeed.initialize(model=Stack(64, 2), config=config)  # imports and one-off buffers
    warm.backward(warm(torch.randn(4, 64)))
    warm.step()
    warm.destroy()
    del warm
    torch.manual_seed(0)
    before = _rss_bytes()
    with shardspeed.zero.Init(remote_device="nvme", config_dict_or_path=config):
        model = Stack()
    numel = sum(p.ds_numel for p in model.parameters())
    engine, *_ = shardspeed.initialize(model=model, config=config)
    x = torch.randn(4, 1024)
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
    grown = _rss_bytes() - before
    disk = engine.optimizer.nvme.disk_bytes() + engine.optimizer.coordinator.tier.disk_bytes()
    shard = numel // world
    kept = [s.grad_shard for s in engine.optimizer.grads.slots if s.grad_shard is not None]
    grads = engine.memory_breakdown()["grads"]
    engine.destroy()  # must not gather a model that may not fit in memory
    grown = max(grown, _rss_bytes() - before)
    del dist
    return {"grown": grown, "disk": disk, "shard": shard, "sub_group": sub_group, "prefetch": prefetch,
            "grad_shards_kept": len(kept), "grad_bytes": grads}  # fmt: skip


def test_state_lives_in_files_and_memory_stays_small(tmp_path):
    for rank in run_ranks(_tiers, 2, str(tmp_path), 2, timeout=300):
        shard = rank["shard"]
        # Files: the fp32 parameter shard (4 B), its fp32 master (4 B), Adam's two moments (8 B) and the
        # gradient (4 B), which goes to its sub-group's file during backward.
        assert 0.95 * 20 * shard <= rank["disk"] <= 1.1 * 20 * shard, rank
        # No gradient shard is kept in memory between backward and step ...
        assert rank["grad_shards_kept"] == 0 and rank["grad_bytes"] == 0, rank
        # ... so memory holds one sub-group (16 B per element with its gradient), the parameter read-ahead
        # buffers and what one gathered layer needs: less than the fp32 gradient shard alone, let alone
        # the 20 B per element of training state.
        in_memory = 16 * rank["sub_group"] + 4 * rank["prefetch"]
        slack = 24 * 2**20  # allocator, gathered layers and their gradients, Gloo buffers
        assert rank["grown"] < in_memory + slack, rank
        assert rank["grown"] < 4 * shard, rank
    assert os.listdir(tmp_path) == []


def _bad_paths(root: str, world: int) -> list[str]:
    import shardspeed
    from shardspeed.zero.swap.folder import PREFIX

    messages = []
    not_a_folder = f"{root}/a-file"
    with open(not_a_folder, "w") as f:
        f.write("keep me")
    read_only = f"{root}/read-only"
    os.mkdir(read_only, 0o500)
    for path in (not_a_folder, f"{not_a_folder}/below", read_only):
        config = base_config(zero_optimization=_zero3("nvme", None, root))
        config["zero_optimization"]["offload_param"]["nvme_path"] = path
        try:
            shardspeed.initialize(model=nn.Linear(200, 200), config=config)
            messages.append("accepted")
        except Exception as error:
            messages.append(str(error))
    # A folder left by a process that no longer exists is removed at the next start; a live one is kept.
    stale = f"{root}/optim/{PREFIX}999999999-optimizer-rank0-x"
    live = f"{root}/optim/{PREFIX}{os.getppid()}-optimizer-rank0-x"
    for folder in (stale, live):
        os.makedirs(folder)
        open(f"{folder}/0.master", "w").close()
    config = base_config(zero_optimization=_zero3(None, "nvme", root))
    engine, *_ = shardspeed.initialize(model=nn.Linear(200, 200), config=config)
    messages.append(f"stale exists: {os.path.exists(stale)}, live exists: {os.path.exists(live)}")
    engine.destroy()
    return messages


def test_bad_nvme_paths_are_refused_and_stale_files_cleaned(tmp_path):
    (messages,) = run_ranks(_bad_paths, 1, str(tmp_path), 1)
    key = "zero_optimization.offload_param.nvme_path"
    assert f"{key}: '{tmp_path}/a-file' is not a directory (NVMe offload needs" in messages[0]
    assert f"{key}: '{tmp_path}/a-file/below' does not exist and cannot be created" in messages[1]
    assert "bytes" in messages[0] and "bytes" in messages[1]
    if os.geteuid() != 0:  # root may write into a read-only folder
        assert f"{key}: '{tmp_path}/read-only' is not writable" in messages[2]
    assert messages[3] == "stale exists: False, live exists: True"
    assert (tmp_path / "a-file").read_text() == "keep me"


def test_too_small_nvme_path_names_the_bytes_needed(tmp_path):
    from shardspeed.config import ConfigError
    from shardspeed.zero.swap.folder import check_nvme_path

    key = "zero_optimization.offload_param.nvme_path"
    with pytest.raises(
        ConfigError, match=rf"{key}: '.*' has [\d,]+ bytes free, NVMe offload needs 4,611,686,0"
    ):
        check_nvme_path(str(tmp_path), 2**62, key)


def _save_resume(root: str, world: int) -> dict:
    import copy

    import torch.distributed as dist

    import shardspeed

    nvme = base_config(zero_optimization=_zero3("nvme", "nvme", f"{root}/swap"), **BF16)
    plain = base_config(zero_optimization=_zero3(None, None, root), **BF16)

    def engine_for(config):
        torch.manual_seed(0)
        engine, *_ = shardspeed.initialize(model=TinyGPT(), config=copy.deepcopy(config))
        return engine

    def accessors(engine) -> dict:
        # a backward with no step after it: its gradients wait in the swap files (NVMe) or in memory
        engine.backward(engine(micro_batch(data, 0, 0, rank, world, engine.train_micro_batch_size_per_gpu())))
        params = dict(engine.module.named_parameters())
        return {
            name: (shardspeed.zero.safe_get_full_fp32_param(p),
                   shardspeed.zero.safe_get_full_optimizer_state(p, "exp_avg_sq"),
                   shardspeed.zero.safe_get_full_grad(p))
            for name, p in params.items() if p.requires_grad
        }  # fmt: skip

    def most_resident(swapper) -> list[int]:
        """Record the most sub-groups in memory at once from now on (checkpoints go one at a time)."""
        peak, swap_in = [0], swapper.swap_in

        def counting_swap_in(index, gradient=False):
            swap_in(index, gradient)
            peak[0] = max(peak[0], len(swapper._resident))

        swapper.swap_in = counting_swap_in
        return peak

    engine = engine_for(nvme)
    data = token_batches(6, engine.train_batch_size())
    rank = dist.get_rank()
    accessors(engine)  # before any step: the state accessors on a fresh engine, and a gradient to forget
    engine.zero_grad()
    train_engine(engine, data, range(3), rank, world)
    saving = most_resident(engine.optimizer.nvme)
    engine.save_checkpoint(f"{root}/ckpt")
    saved_with = saving[0]
    train_engine(engine, data, range(3, 6), rank, world)
    out = {"uninterrupted": full_params(engine), "uninterrupted state": accessors(engine),
           "in memory while saving": saved_with}  # fmt: skip
    engine.destroy()
    for name, config in (("nvme", nvme), ("plain", plain)):
        engine = engine_for(config)
        if name == "nvme":
            loading = most_resident(engine.optimizer.nvme)
        engine.load_checkpoint(f"{root}/ckpt")
        if name == "nvme":
            out["in memory while loading"] = loading[0]
        train_engine(engine, data, range(3, 6), rank, world)
        out[name] = full_params(engine)
        out[f"{name} state"] = accessors(engine)
        engine.destroy()
    return out


def test_all_nvme_checkpoints_resume_exactly_and_accessors_read_swapped_state(tmp_path):
    for out in run_ranks(_save_resume, 2, str(tmp_path), 2, timeout=300):
        # a save maps the swap files instead of reading them in; a load brings one sub-group in at a time
        assert out["in memory while saving"] == 0 and out["in memory while loading"] == 1, out
        for name in ("nvme", "plain"):
            assert max_diff(out[name], out["uninterrupted"]) == 0, name
            for param, (master, moment, grad) in out[f"{name} state"].items():
                expected_master, expected_moment, expected_grad = out["uninterrupted state"][param]
                assert master is not None and moment is not None, param
                assert torch.equal(master, expected_master) and torch.equal(moment, expected_moment), param
                assert grad.abs().sum() > 0 and torch.equal(grad, expected_grad), param
    for sub in ("optim", "params"):  # the nvme_path folders are left, empty
        assert os.listdir(tmp_path / "swap" / sub) == []


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"block_size": 4096, "queue_depth": 2, "thread_count": 1, "single_submit": True},
        {"block_size": 10_000, "queue_depth": 3, "overlap_events": False},
    ],
)
def test_async_file_io_round_trips_aligned_and_unaligned_tensors(tmp_path, settings):
    from shardspeed.zero.swap.aio import AioSettings, AsyncFileIO, aligned_empty

    io = AsyncFileIO(AioSettings(**settings))
    sources = [torch.randn(3 * 1024 * 1024 + 5), torch.arange(1001, dtype=torch.int16), torch.randn(0)]
    aligned = aligned_empty(sources[0].numel(), torch.float32)
    aligned.copy_(sources[0])
    sources.append(aligned)  # page-aligned: its whole blocks can go through O_DIRECT
    writes = [io.write(t, str(tmp_path / f"{i}")) for i, t in enumerate(sources)]
    for request in writes:
        request.wait()
    targets = [aligned_empty(t.numel(), t.dtype) for t in sources]
    reads = [io.read(t, str(tmp_path / f"{i}")) for i, t in enumerate(targets)]
    for request, source in zip(reads, sources):
        assert torch.equal(request.wait(), source)
    assert io.bytes_read == io.bytes_written == sum(t.numel() * t.element_size() for t in sources)
    with pytest.raises(OSError, match="moved nothing"):
        io.read(torch.empty(10), str(tmp_path / "2")).wait()  # the file holds no bytes
    io.close()
