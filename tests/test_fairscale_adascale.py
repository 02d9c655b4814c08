"""FairScale's AdaScale on shardspeed: the gain against a reference computed here from the paper's formula.

The reference takes every micro-batch's gradient separately (torch.autograd.grad on a copy of the model),
computes the gain ratio of the AdaScale paper in float64 and smooths it with the closed form of the debiased
EWMA (a weighted sum over all past steps, not the recursion the optimizer uses), then trains plain SGD with
the learning rate times that gain. AdaScale (single process with accumulation, and 2 Gloo ranks under DDP)
must give the same gains and reach the same parameters.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from shardspeed.fairscale.adascale import AdaScale
from tests.harness import run_ranks

LR = 0.1


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(2, 3, generator=g), torch.randn(2, 2, generator=g)


def _loss(net, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(net(x), y)


def _groups(net) -> list[list[nn.Parameter]]:
    return [list(net[0].parameters()), list(net[2].parameters())]


def _reference(steps: int, micro_batches: int, smoothing: float) -> tuple[list[list[float]], dict]:
    """Per-step per-group gains and the final parameters of SGD with lr * gain (scale = micro_batches)."""
    net = _net()
    groups = _groups(net)
    n = scale = micro_batches
    history: list[torch.Tensor] = []  # per step: [group] -> (var, sqr)
    gains = []
    for step in range(steps):
        grads = [
            torch.autograd.grad(_loss(net, *_micro_batch(step, i)), [p for g in groups for p in g])
            for i in range(n)
        ]
        stats, mean_grads = [], []
        offset = 0
        for group in groups:
            per_micro = [
                torch.cat([gr.double().flatten() for gr in grads[i][offset : offset + len(group)]])
                for i in range(n)
            ]
            mean = torch.stack(per_micro).mean(0)
            mean_grads.append(
                [torch.stack([grads[i][offset + k] for i in range(n)]).mean(0) for k in range(len(group))]
            )
            offset += len(group)
            sample_var = sum(((g - mean) ** 2).sum() for g in per_micro) / (
                n - 1
            )  # unbiased, one micro-batch
            var = float(sample_var) * scale / n  # the variance of one micro-batch, relative to the batch
            sqr = float(mean.pow(2).sum()) - var / scale  # |true gradient|^2: |mean|^2 less its noise
            stats.append(torch.tensor([max(var, 1e-6), max(sqr, 0.0)], dtype=torch.float64))
        history.append(torch.stack(stats))
        weights = torch.tensor(
            [(1 - smoothing) * smoothing ** (step - k) for k in range(step + 1)], dtype=torch.float64
        )
        smoothed = (weights[:, None, None] * torch.stack(history)).sum(0) / weights.sum()
        step_gains = [float((v + s) / (v / scale + s)) for v, s in smoothed]
        gains.append(step_gains)
        with torch.no_grad():
            for group, grads_of_group, gain in zip(groups, mean_grads, step_gains):
                for p, g in zip(group, grads_of_group):
                    p -= LR * gain * g
    return gains, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _sgd_adascale(net, **kwargs) -> AdaScale:
    groups = _groups(net)
    return AdaScale(torch.optim.SGD([{"params": groups[0]}, {"params": groups[1]}], lr=LR), **kwargs)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("scaled_loss", [True, False])
def test_single_process_accumulation_matches_the_reference(scaled_loss):
    steps, micro = 3, 3
    expected_gains, expected_params = _reference(steps, micro, smoothing=0.9)
    net = _net()
    opt = _sgd_adascale(net, num_gradients_to_accumulate=micro, is_scaled_loss=scaled_loss, smoothing=0.9)
    for step in range(steps):
        for i in range(micro):
            loss = _loss(net, *_micro_batch(step, i))
            (loss / micro if scaled_loss else loss).backward()
        if not scaled_loss:
            opt.scale_grad_by_num_grads_to_accum()
        assert [opt.gain(0), opt.gain(1)] == pytest.approx(expected_gains[step], rel=1e-6)
        opt.step()
        assert [g["lr"] for g in opt.param_groups] == [LR, LR]  # the gain is applied for the step only
        opt.zero_grad()
    assert _max_diff({k: v for k, v in net.state_dict().items()}, expected_params) < 1e-6
    assert 1.0 <= opt.gain() <= micro


def test_gain_is_scale_for_orthogonal_and_one_for_equal_gradients():
    net = nn.Linear(2, 1, bias=False)
    opt = AdaScale(torch.optim.SGD(net.parameters(), lr=LR), num_gradients_to_accumulate=2)
    for x in ([1.0, 0.0], [0.0, 1.0]):  # orthogonal gradients: all noise, a 2x batch is worth 2 steps
        net(torch.tensor(x)).sum().backward()
    assert opt.gain() == pytest.approx(2.0)
    opt.unhook()
    net = nn.Linear(2, 1, bias=False)
    opt = AdaScale(torch.optim.SGD(net.parameters(), lr=LR), num_gradients_to_accumulate=2)
    for _ in range(2):  # identical gradients: no noise, no gain
        net(torch.tensor([1.0, 1.0])).sum().backward()
    assert opt.gain() == pytest.approx(1.0, abs=1e-5)


def test_set_scale_rescales_the_variance_and_refusals_name_the_value():
    net = nn.Linear(2, 1, bias=False)
    opt = AdaScale(torch.optim.SGD(net.parameters(), lr=LR), num_gradients_to_accumulate=2)
    for x in ([1.0, 0.0], [0.0, 1.0]):
        net(torch.tensor(x)).sum().backward()
    var = opt.state["adascale"]["grad_var_avg"].clone()
    opt.set_scale(4.0)
    assert opt.scale == 4.0
    assert torch.allclose(opt.state["adascale"]["grad_var_avg"], var * 2 / 4)
    with pytest.raises(ValueError, match=r"scale must be at least 1, got 0\.5"):
        opt.set_scale(0.5)
    with pytest.raises(RuntimeError, match="more than one gradient per step"):
        AdaScale(torch.optim.SGD(net.parameters(), lr=LR))
    with pytest.raises(ValueError, match="num_gradients_to_accumulate must be at least 1, got 0"):
        opt.set_num_gradients_to_accumulate(0)
    opt.set_num_gradients_to_accumulate(5)
    assert opt.smoothing == pytest.approx(1 - 5 / 1000)
    assert AdaScale(torch.optim.SGD(net.parameters(), lr=LR), world_size=2, smoothing=0.25).smoothing == 0.25
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\), got 1\.5"):
        AdaScale(torch.optim.SGD(net.parameters(), lr=LR), world_size=2, smoothing=1.5)


def test_gradients_kept_out_of_param_grad_are_refused():
    net = nn.Linear(2, 1)
    opt = AdaScale(torch.optim.SGD(net.parameters(), lr=LR), num_gradients_to_accumulate=2)
    for p in net.parameters():  # as ShardedDataParallel does: the gradient leaves .grad for a shard
        p.register_post_accumulate_grad_hook(lambda param: setattr(param, "grad", None))
    net(torch.ones(2)).sum().backward()
    with pytest.raises(RuntimeError, match=r"every param\.grad is None"):
        net(torch.ones(2)).sum().backward()
    assert opt.gain() == 1.0  # the estimates were not updated from the missing gradients


def test_state_dict_round_trip_and_lr_scheduler():
    net = _net()
    opt = _sgd_adascale(net, num_gradients_to_accumulate=2)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        for i in range(2):
            (_loss(net, *_micro_batch(step, i)) / 2).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    assert [g["lr"] for g in opt.param_groups] == [LR / 4, LR / 4]
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = _sgd_adascale(_net(), num_gradients_to_accumulate=2)
    fresh.load_state_dict(torch.load(buffer))  # weights_only: the estimates are plain tensors
    assert [fresh.gain(0), fresh.gain(1)] == [opt.gain(0), opt.gain(1)]
    assert fresh.gain() != 1.0  # the estimates came with the state, not the fresh defaults


# -- 2 ranks under DistributedDataParallel ------------------------------------------------------------------


def _ranks_body() -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = _net()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = _sgd_adascale(net, num_gradients_to_accumulate=2, smoothing=0.9)
    gains = []
    for step in range(3):
        for i in range(2):  # this rank's micro-batches are the reference's 2*rank and 2*rank+1
            context = ddp.no_sync() if i == 0 else torch.enable_grad()
            with context:
                (_loss(ddp, *_micro_batch(step, 2 * rank + i)) / 2).backward()
        gains.append([opt.gain(0), opt.gain(1)])
        opt.step()
        opt.zero_grad()
    return {"gains": gains, "params": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def test_two_ranks_under_ddp_match_the_reference():
    expected_gains, expected_params = _reference(3, 4, smoothing=0.9)
    for rank in run_ranks(_ranks_body, 2):
        for got, want in zip(rank["gains"], expected_gains):
            assert got == pytest.approx(want, rel=1e-5)
        assert _max_diff(rank["params"], expected_params) < 1e-5
