"""DeepSpeed's runtime paths on 2 ranks: the optimizer-wrapper classes as isinstance checks, the local ZeRO
accessors against the full ones, `reduce_scatter_coalesced` and `PartitionedTensor` against a one-process
computation, the CPU device count, and `deepspeed.utils.zero_to_fp32` (functions and CLI) on a checkpoint
the same job saved. One world-2 spawn does every collective part.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint.files import zero_optim_states_name

from common import base_config, build_model, train_engine
from harness import run_ranks
from models import token_batches

WORLD = 2
CLASSES = {
    "stage3": "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
    "stage12": "runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "fp16": "runtime.fp16.fused_optimizer.FP16_Optimizer",
    "fp16_unfused": "runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
    "bf16": "runtime.bf16_optimizer.BF16_Optimizer",
}
CONFIGS = {  # label: (config overrides, the one DeepSpeed class it is)
    "s0-fp32": ({}, None),
    "s0-fp16-adamw": ({"fp16": {"enabled": True}}, "fp16"),
    "s0-fp16-lamb": (
        {"fp16": {"enabled": True}, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}},
        "fp16_unfused",
    ),
    "s0-bf16": ({"bf16": {"enabled": True}}, "bf16"),  # shardspeed accumulates bf16 gradients in fp32
    "s0-bf16-bf16-accum": (
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
        "fp16_unfused",
    ),
    "s0-bf16-fp32-accum": ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, "bf16"),
    "s1": ({"zero_optimization": {"stage": 1}}, "stage12"),
    # DeepSpeed's engine builds its BF16_Optimizer (its own ZeRO-1) for bf16 + fp32 accumulation at stage 1
    "s1-bf16-fp32-accum": (
        {
            "zero_optimization": {"stage": 1},
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
        },
        "bf16",
    ),
    "s1-bf16-fp32-accum-offload": (
        {
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
        },
        "stage12",
    ),
    "s2-bf16-fp32-accum": (
        {
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
        },
        "stage12",
    ),
    "s2": ({"zero_optimization": {"stage": 2}}, "stage12"),
    "s3": ({"zero_optimization": {"stage": 3}}, "stage3"),
}


def _engine(overrides: dict):
    import shardspeed

    torch.manual_seed(0)
    model = build_model()
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=base_config(**overrides)
    )
    return engine


def _wrapper_classes() -> dict:
    from shardspeed.compat.finder import resolve

    found = {}
    for label, (overrides, _) in CONFIGS.items():
        engine = _engine(overrides)
        found[label] = sorted(k for k, path in CLASSES.items() if isinstance(engine.optimizer, resolve(path)))
        engine.destroy()
    return found


def _local_accessors(stage: int) -> dict:
    """Local parts against full values on a ZeRO engine after one backward (before the step)."""
    import torch.distributed as dist

    from shardspeed.compat.finder import resolve

    get = {name: resolve(f"utils.{name}") for name in (
        "safe_get_full_grad", "safe_get_local_grad", "safe_set_local_grad", "safe_set_full_grad",
        "safe_get_full_fp32_param", "safe_get_local_fp32_param", "safe_set_local_fp32_param",
        "safe_get_full_optimizer_state", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
    )}  # fmt: skip
    engine = _engine(
        {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}, "gradient_accumulation_steps": 1}
    )
    data = token_batches(2, engine.train_batch_size())
    rank = dist.get_rank()
    engine.backward(engine(data[0, rank * 2 : rank * 2 + 2]))
    name, param = next((n, p) for n, p in engine.module.named_parameters() if p.numel() > 40)

    def gathered(local: torch.Tensor) -> torch.Tensor:
        """Every rank's part in rank order (parts may differ in length: padded for the all-gather)."""
        lengths = [torch.zeros(1, dtype=torch.long) for _ in range(WORLD)]
        dist.all_gather(lengths, torch.tensor([local.numel()]))
        width = int(max(lengths))
        padded = torch.zeros(width)
        padded[: local.numel()] = local.float()
        parts = [torch.zeros(width) for _ in range(WORLD)]
        dist.all_gather(parts, padded)
        out["lengths"] = [int(n) for n in lengths]
        return torch.cat([part[: int(n)] for part, n in zip(parts, lengths)])

    def norm_groups() -> tuple:
        """DeepSpeed's `_get_norm_groups()`, with the norm of every full gradient and the wrapper's own."""
        groups = engine.optimizer._get_norm_groups()
        full = [get["safe_get_full_grad"](p).float() for p in engine.module.parameters()]
        reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full]))
        return [float(g) for g in groups], float(reference), engine.optimizer._global_norm()

    out = {"name": name}
    out["norm_groups"] = norm_groups()
    out["full_grad"] = get["safe_get_full_grad"](param)
    out["local_grads"] = gathered(get["safe_get_local_grad"](param))
    get["safe_set_local_grad"](param, torch.full_like(get["safe_get_local_grad"](param), float(rank + 1)))
    out["after_set_local"] = get["safe_get_full_grad"](param)
    out["norm_groups_after_set"] = norm_groups()  # the set gradient counts
    get["safe_set_full_grad"](param, torch.arange(param.numel(), dtype=torch.float32).view(param.shape))
    out["after_set_full"] = get["safe_get_full_grad"](param)
    out["full_fp32"] = get["safe_get_full_fp32_param"](param)
    out["local_fp32"] = gathered(get["safe_get_local_fp32_param"](param))
    get["safe_set_local_fp32_param"](param, torch.zeros_like(get["safe_get_local_fp32_param"](param)))
    out["fp32_after_set"] = get["safe_get_full_fp32_param"](param)
    out["norm_before_step"] = engine.optimizer._global_grad_norm
    engine.step()
    out["last_norm"] = (engine.optimizer._global_grad_norm, engine.get_global_grad_norm())
    out["exp_avg"] = get["safe_get_full_optimizer_state"](param, "exp_avg")
    out["local_exp_avg"] = gathered(get["safe_get_local_optimizer_state"](param, "exp_avg"))
    try:
        get["safe_get_local_optimizer_state"](param, "no_such_state")
    except KeyError as error:
        out["bad_key"] = str(error)
    engine.destroy()
    return out


def _collectives() -> dict:
    import torch.distributed as dist

    from shardspeed.runtime.comm import coalesced_collectives as coalesced
    from shardspeed.runtime.utils import PartitionedTensor as partitioned

    rank = dist.get_rank()
    inputs = [rank * torch.arange(0, 6.0), rank * torch.arange(6, 9.0), torch.full((1,), float(rank))]
    outputs = coalesced.reduce_scatter_coalesced(inputs, dist.group.WORLD)
    full = torch.arange(23.0).view(23, 1) * (rank + 1)  # rank 1's values differ: each keeps its own part
    dist.broadcast(full, src=0)
    part = partitioned(full, group=dist.group.WORLD)
    again = partitioned.from_meta(part.to_meta(), part.local_data, dist.group.WORLD)
    return {
        "coalesced": [o.clone() for o in outputs],
        "partition_full": part.full(),
        "from_meta_full": again.full(),
        "local_sizes": list(part.local_size()),
        "device_count": shardspeed_device_count(),
    }


def shardspeed_device_count() -> int:
    from shardspeed.accelerator import get_accelerator

    return get_accelerator().device_count()


def _save_checkpoint(root: str) -> dict:
    import torch.distributed as dist

    from shardspeed.zero import safe_get_full_fp32_param

    engine = _engine({"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000}})
    train_engine(engine, token_batches(2, engine.train_batch_size()), range(2), dist.get_rank(), WORLD)
    engine.save_checkpoint(root, tag="step2")
    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    engine.destroy()
    return masters


def _job(root: str) -> dict:
    return {
        "classes": _wrapper_classes(),
        "local2": _local_accessors(2),
        "local3": _local_accessors(3),
        "collectives": _collectives(),
        "masters": _save_checkpoint(root),
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat") / "ckpt"
    return root, run_ranks(_job, WORLD, str(root), timeout=300)


def test_each_configuration_is_exactly_the_deepspeed_class_it_would_build(job):
    for rank in job[1]:
        for label, (_, expected) in CONFIGS.items():
            assert rank["classes"][label] == ([expected] if expected else []), label


@pytest.mark.parametrize("stage", [2, 3])
def test_local_parts_put_together_are_the_full_values(job, stage):
    first, second = (rank[f"local{stage}"] for rank in job[1])
    full = first["full_grad"].reshape(-1)
    assert torch.equal(first["local_grads"][: full.numel()], full)
    assert torch.equal(first["full_grad"], second["full_grad"])
    assert sum(first["lengths"]) == full.numel()
    # each rank set its own part to rank + 1: the full gradient is that, part by part
    parts = [torch.full((n,), float(r + 1)) for r, n in enumerate(first["lengths"])]
    assert torch.equal(first["after_set_local"].reshape(-1), torch.cat(parts))
    expected = torch.arange(full.numel(), dtype=torch.float32)
    assert torch.equal(first["after_set_full"].reshape(-1), expected)
    assert torch.equal(first["local_fp32"][: full.numel()], first["full_fp32"].reshape(-1))
    assert torch.count_nonzero(first["fp32_after_set"]) == 0
    assert torch.equal(first["local_exp_avg"][: full.numel()], first["exp_avg"].reshape(-1).float())
    assert "no optimizer state 'no_such_state'" in first["bad_key"]
    for key in ("norm_groups", "norm_groups_after_set"):
        groups, reference, global_norm = first[key]
        assert len(groups) >= 1 and first[key] == second[key]  # the same on every rank
        assert abs(torch.linalg.vector_norm(torch.tensor(groups)).item() - reference) <= 1e-4 * reference
        assert abs(global_norm - reference) <= 1e-4 * reference
    assert first["norm_groups_after_set"][1] != first["norm_groups"][1]
    # DeepSpeed's `_global_grad_norm`: the norm the last step took, what get_global_grad_norm() reports
    assert first["norm_before_step"] is None
    assert first["last_norm"][0] is not None and first["last_norm"][0] == first["last_norm"][1] > 0


def test_reduce_scatter_coalesced_and_partitioned_tensor(job):
    first, second = (rank["collectives"] for rank in job[1])
    # inputs are rank * values; the average over ranks 0 and 1 is values / 2, each rank keeping its part
    assert torch.equal(first["coalesced"][0], torch.arange(0, 3.0) / 2)
    assert torch.equal(second["coalesced"][0], torch.arange(3, 6.0) / 2)
    assert (
        torch.equal(first["coalesced"][1], torch.arange(6, 8.0) / 2) and second["coalesced"][1].numel() == 1
    )
    assert first["coalesced"][2].numel() == 1 and second["coalesced"][2].numel() == 0
    reference = torch.arange(23.0).view(23, 1)
    for rank in (first, second):
        assert torch.equal(rank["partition_full"], reference) and torch.equal(
            rank["from_meta_full"], reference
        )
    assert first["local_sizes"] == [12] and second["local_sizes"] == [11]
    assert first["device_count"] == second["device_count"] == WORLD  # the CPU counts local ranks


def test_zero_to_fp32_functions_and_cli_by_deepspeeds_path(job, tmp_path):
    import shardspeed as deepspeed

    root, ranks = job
    zero_to_fp32 = deepspeed.utils.zero_to_fp32
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(root), tag="step2")
    masters = ranks[0]["masters"]
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    files = zero_to_fp32.get_optim_files(root / "step2")
    assert [Path(f).name for f in files] == [zero_optim_states_name(rank) for rank in range(WORLD)]
    with pytest.raises(FileNotFoundError, match=r"no files matching '\*_optim_states\.pt'"):
        zero_to_fp32.get_optim_files(tmp_path)
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(build_model(), str(root), tag="step2")
    assert torch.equal(
        dict(model.named_parameters())[next(iter(masters))].detach(), next(iter(masters.values()))
    )
    out = tmp_path / "fp32"
    cli = subprocess.run(
        [sys.executable, "-m", "shardspeed.utils.zero_to_fp32", str(root), str(out), "-t", "step2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    written = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(written[n], v) for n, v in masters.items())


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (self.weight * x).sum()


def _boundary_gradients() -> list:
    """DeepSpeed's TestBF16OptimizerGradReduction: the gradient of the boundary micro-batch is reduced (and
    averaged) by the end of its backward, seen through `fp32_groups_gradients_flat`."""
    import torch.distributed as dist

    import shardspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True, "immediate_grad_update": False}, "data_types": {"grad_accum_dtype": "fp32"}}  # fmt: skip
    model = _Scale()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    offset = 18 * dist.get_rank()
    inputs = [torch.tensor([1, 3, 5, 7], dtype=torch.bfloat16) + offset,
              torch.tensor([11, 13, 15, 17], dtype=torch.bfloat16) + offset]  # fmt: skip
    for i, x in enumerate(inputs):
        engine.set_gradient_accumulation_boundary(i == len(inputs) - 1)
        engine.backward(engine(x))
    return engine.optimizer.fp32_groups_gradients_flat


def test_bf16_zero1_boundary_gradients_are_reduced_over_ranks_and_micro_batches():
    # rank 0: 1+11, 3+13, ...; rank 1: the same + 2*18; averaged over 2 ranks and 2 micro-batches
    for flat in run_ranks(_boundary_gradients, WORLD):
        assert len(flat) == 1 and torch.equal(flat[0], torch.tensor([15.0, 17.0, 19.0, 21.0])), flat
