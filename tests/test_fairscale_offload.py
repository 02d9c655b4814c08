"""FairScale's single-process parts on the CPU: OffloadModel (the same parameters as the plain model, with
and without activation checkpointing and microbatches, under autocast, accumulating across backward calls),
checkpoint_wrapper and Pipe (the plain model's outputs and gradients)."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from shardspeed.fairscale.checkpoint_wrapper import checkpoint_wrapper, is_checkpointing, is_recomputing
from shardspeed.fairscale.offload_model import OffloadModel, split_by_parameters
from shardspeed.fairscale.pipe import CHECKPOINT_MODES, Pipe

STEPS = 3


def _layers(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 4))  # fmt: skip


def _train(model, autocast: bool, accumulate: int = 1) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        for part in range(accumulate):
            xs, ys = x.chunk(accumulate)[part], y.chunk(accumulate)[part]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.mse_loss(model(xs).float(), ys) / accumulate
            loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]  # the layers' order in both models


def _flat(params: list) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params])


@pytest.mark.parametrize(
    "checkpoint_activation, num_microbatches, autocast",
    [(False, 1, False), (True, 1, False), (True, 2, False), (True, 1, True), (False, 2, True)],
)
def test_offload_model_trains_as_the_plain_model(checkpoint_activation, num_microbatches, autocast):
    expected = _flat(_train(_layers(), autocast))
    model = OffloadModel(model=_layers(), device=torch.device("cpu"), offload_device=torch.device("cpu"),
                         num_slices=3, checkpoint_activation=checkpoint_activation,
                         num_microbatches=num_microbatches)  # fmt: skip
    assert len(model.model_slices) == 3
    got = _flat(_train(model, autocast))
    tolerance = 1e-6 if not autocast else (1e-6 if num_microbatches == 1 else 5e-3)
    assert (got - expected).abs().max().item() < tolerance


def test_gradients_accumulate_across_backward_calls():
    expected = _flat(_train(_layers(), False, accumulate=2))
    model = OffloadModel(model=_layers(), device="cpu", num_slices=2, checkpoint_activation=True)
    assert (_flat(_train(model, False, accumulate=2)) - expected).abs().max().item() < 1e-6


def test_split_keeps_order_and_balances_parameters():
    layers = list(_layers())
    slices = split_by_parameters(layers, 3)
    assert [m for s in slices for m in s] == layers and len(slices) == 3
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        OffloadModel(model=nn.Linear(2, 2), device="cpu")


def _grads(model, x, **kwargs) -> list[torch.Tensor]:
    model.zero_grad()
    model(x, **kwargs).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.phases = []

    def forward(self, x, scale=1.0):
        self.phases.append((is_checkpointing(), is_recomputing()))
        return torch.tanh(self.linear(x)) * scale


@pytest.mark.parametrize("offload_to_cpu", [False, True])
def test_checkpoint_wrapper_gives_the_plain_gradients(offload_to_cpu):
    torch.manual_seed(0)
    plain = _Block()
    wrapped = copy.deepcopy(plain)
    checkpoint_wrapper(wrapped, offload_to_cpu=offload_to_cpu)
    x = torch.randn(4, 8)
    for a, b in zip(_grads(plain, x, scale=2.0), _grads(wrapped, x, scale=2.0)):
        assert torch.equal(a, b)
    assert wrapped.phases == [(True, False), (False, True)]  # forward, then recomputation in backward


def test_checkpoint_wrapper_updates_batch_norm_statistics_once():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(8, 4)
    for a, b in zip(_grads(plain, x), _grads(wrapped, x)):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.equal(plain[1].running_mean, wrapped[1].running_mean)
    assert plain[1].num_batches_tracked == wrapped[1].num_batches_tracked == 1


def test_pipe_matches_the_sequential_model():
    model = _layers()
    x = torch.randn(8, 8)
    expected_out, expected_grads = model(x), _grads(model, x)
    for mode in CHECKPOINT_MODES:
        pipe = Pipe(copy.deepcopy(model), balance=[3, 4], chunks=4, checkpoint=mode)
        assert len(pipe) == 7 and len(pipe.partitions) == 2
        assert torch.allclose(pipe(x), expected_out, atol=1e-6)
        for a, b in zip(_grads(pipe, x), expected_grads):
            assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="balance"):
        Pipe(_layers(), balance=[3, 3])
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="duplicate children"):
        Pipe(nn.Sequential(layer, layer), balance=[1, 1])
    with pytest.raises(IndexError, match="2 partitions need as many devices"):
        Pipe(_layers(), balance=[3, 4], devices=["cpu"])


def test_pipe_keeps_layer_names_and_takes_the_mode_as_a_string():
    class Mode:
        def __str__(self):
            return "never"

    model = nn.Sequential(OrderedDict([("a", nn.Linear(1, 1)), ("b", nn.Linear(1, 1))]))
    pipe = Pipe(model, balance=(1, 1), devices=("cpu", "cpu"), chunks=2.0, checkpoint=Mode())
    names = {name for name, _ in pipe.named_modules()}
    assert {"partitions.0.a", "partitions.1.b"} <= names
    assert pipe.checkpoint == "never" and pipe.chunks == 2 and isinstance(pipe.chunks, int)


def test_pipe_takes_tuples_of_tensors_and_an_empty_sequential():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, pair):
            x, y = pair
            return self.a(x) + self.b(y), y * 2

    torch.manual_seed(0)
    model = nn.Sequential(Pair(), Pair())
    x, y = torch.randn(6, 2), torch.randn(6, 2)
    expected = model((x, y))
    for mode in CHECKPOINT_MODES:
        pipe = Pipe(copy.deepcopy(model), balance=[1, 1], chunks=3, checkpoint=mode)
        out = pipe((x, y))
        assert isinstance(out, tuple) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out, expected))
    empty = Pipe(nn.Sequential(), [])
    assert empty((x,))[0] is x
    with pytest.raises(TypeError, match="a tensor or a tuple of tensors, got int"):
        empty(42)
    with pytest.raises(ValueError, match="different chunk counts"):
        Pipe(copy.deepcopy(model), balance=[1, 1], chunks=3)((x, y[:1]))


def test_pipe_runs_gpipes_clock_schedule_and_stops_at_the_clock_that_raises():
    timeline = []

    class Log(nn.Module):
        def __init__(self, partition, fail_on=None):
            super().__init__()
            self.partition, self.seen, self.fail_on = partition, 0, fail_on

        def forward(self, x):
            if self.seen == self.fail_on:
                raise KeyError("micro-batch failed")
            timeline.append((self.seen, self.partition))
            self.seen += 1
            return x

    Pipe(nn.Sequential(Log(0), Log(1)), balance=[1, 1], chunks=3)(torch.rand(3, 1))
    # clock k runs micro-batch i on partition k - i
    assert timeline == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (2, 1)]
    timeline.clear()
    pipe = Pipe(nn.Sequential(Log(0), Log(1), Log(2, fail_on=0)), balance=[1, 1, 1], chunks=3)
    with pytest.raises(KeyError, match="micro-batch failed"):
        pipe(torch.rand(3, 1))
    # micro-batch 0 fails on partition 2 at clock 2; that clock still finishes, nothing after it runs
    assert timeline == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1)]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batch_norm_keeps_the_whole_batchs_running_statistics(momentum):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=momentum), nn.Linear(4, 2))
    for mode in CHECKPOINT_MODES:
        reference = copy.deepcopy(plain)
        pipe = Pipe(copy.deepcopy(plain), balance=[2, 1], chunks=3, checkpoint=mode, deferred_batch_norm=True)
        for step in range(2):
            x = torch.randn(9, 3, generator=torch.Generator().manual_seed(step)) * (step + 1)
            pipe(x).sum().backward()
            reference(x).sum().backward()
        norm, expected = pipe[1], reference[1]
        assert torch.allclose(norm.running_mean, expected.running_mean, atol=1e-6), mode
        assert torch.allclose(norm.running_var, expected.running_var, atol=1e-6), mode
        assert int(norm.num_batches_tracked) == 2
        # the batch norm's state keeps its names (as a plain batch norm's, under its partition)
        assert {k.split(".", 2)[2] for k in pipe.state_dict()} == set(reference.state_dict())
        pipe.eval(), reference.eval()
        x = torch.randn(5, 3)
        assert torch.allclose(pipe(x), reference(x), atol=1e-5)
