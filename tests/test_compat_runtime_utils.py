"""DeepSpeed's `runtime.utils` gradient helpers (compat/mirrors/runtime_utils.py).

On 2 ranks with an expert-parallel group over both, as DeepSpeed's MoE training has it: `clip_grad_norm_`
gives every rank the mean of the ranks' norms (an expert gradient makes them differ) and clips by it;
`CheckOverflow` agrees on an overflow that only one rank's expert gradient holds, and leaves a rank's own
verdict alone where nothing asks it to agree. In one process: `get_weight_norm`'s values and its -1 for
inf/nan, and `count_used_parameters_in_backward` counting only the parameters the running backward reaches.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardspeed.runtime import utils as ds_utils

from harness import run_ranks

WORLD = 2


def _param(value: float, expert: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([value])
    if expert:
        p.allreduce = False  # how DeepSpeed (and shardspeed's MoE layer) marks an expert parameter
    return p


def _ranks_job() -> dict:
    import torch.distributed as dist

    from shardspeed.utils import groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups._create_expert_and_data_parallel(WORLD)
    out = {}

    shared, expert = _param(3.0), _param(4.0 * (rank + 1), expert=True)
    out["norm"] = float(ds_utils.clip_grad_norm_([shared, expert], max_norm=1.0))
    out["clipped"] = [float(shared.grad), float(expert.grad)]

    inf_on_rank1 = float("inf") if rank == 1 else 1.0
    expert_params = [_param(1.0), _param(inf_on_rank1, expert=True)]
    out["expert_overflow"] = ds_utils.CheckOverflow([expert_params]).check()
    flat = torch.cat([p.grad for p in expert_params])
    norm = ds_utils.get_weight_norm([flat])
    out["norm_overflow"] = ds_utils.CheckOverflow([expert_params]).check_using_norm(
        [norm], reduce_overflow=False
    )
    out["clean"] = ds_utils.CheckOverflow([[_param(1.0), _param(2.0, expert=True)]]).check()
    # no expert parameter, no mpu, no engine: each rank answers for its own gradients (DeepSpeed's engine has
    # already all-reduced them there, so the ranks agree through the gradients themselves)
    out["local_only"] = ds_utils.CheckOverflow([[_param(1.0), _param(inf_on_rank1)]]).check()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks_job, WORLD)


def test_clip_grad_norm_averages_the_norm_over_the_data_parallel_ranks(results):
    local = [math.hypot(3.0, 4.0 * (rank + 1)) for rank in range(WORLD)]  # 5 and sqrt(73)
    mean = sum(local) / WORLD
    for rank, result in enumerate(results):
        assert result["norm"] == pytest.approx(mean, rel=1e-6)
        coefficient = 1.0 / (mean + 1e-6)
        assert result["clipped"] == pytest.approx(
            [3.0 * coefficient, 4.0 * (rank + 1) * coefficient], rel=1e-6
        )


def test_check_overflow_agrees_over_the_expert_parallel_group(results):
    assert [r["expert_overflow"] for r in results] == [True, True]
    assert [r["norm_overflow"] for r in results] == [True, True]
    assert [r["clean"] for r in results] == [False, False]
    assert [r["local_only"] for r in results] == [False, True]


def test_clip_grad_norm_in_one_process_is_torchs():
    ours, theirs = [_param(1.0), _param(2.0)], [_param(1.0), _param(2.0)]
    norm = ds_utils.clip_grad_norm_(ours, max_norm=0.1)
    assert float(norm) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(theirs, 0.1)))
    assert [float(p.grad) for p in ours] == pytest.approx([float(p.grad) for p in theirs])


def test_get_weight_norm_values_and_overflow_signal():
    assert ds_utils.get_weight_norm([torch.tensor([3.0]), torch.tensor([4.0])]) == pytest.approx(5.0)
    assert ds_utils.get_weight_norm([torch.tensor([3.0, -7.0])], norm_type=float("inf")) == 7.0
    assert ds_utils.get_weight_norm([torch.tensor([1.0, float("inf")])]) == -1
    assert ds_utils.get_weight_norm([torch.tensor([float("nan")])]) == -1
    assert ds_utils.is_invalid_grad_norm(-1) and not ds_utils.is_invalid_grad_norm(torch.tensor(2.0))


def test_count_used_parameters_in_backward_counts_what_the_backward_reaches():
    used, unused, frozen = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    frozen.requires_grad_(False)
    params = [*used.parameters(), *unused.parameters(), *frozen.parameters()]
    seen = []

    def hook(grad):
        seen.append(ds_utils.count_used_parameters_in_backward(params))
        return grad

    used.weight.register_hook(hook)
    unused(torch.ones(1, 2))  # built, but not part of the loss below
    (used(torch.ones(1, 2)) + frozen(torch.ones(1, 2))).sum().backward()
    assert seen == [2]  # used.weight and used.bias
    with pytest.raises(RuntimeError, match="during backward"):
        ds_utils.count_used_parameters_in_backward(params)
