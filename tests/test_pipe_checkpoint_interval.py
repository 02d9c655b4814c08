"""Pipeline activation checkpointing: the per-interval cache of which layer runs are checkpointed, the
interval setter, and the engine's reentrant/non-reentrant choice (DeepSpeed's `pipeline.use_reentrant`)."""

import pytest

from harness import run_ranks

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "steps_per_print": 1000,
}


def _counting(function):
    """`function`, counting its calls (how many layer runs forward() checkpointed)."""

    def call(*args, **kwargs):
        call.count += 1
        return function(*args, **kwargs)

    call.count = 0
    return call


def checkpoint_job() -> dict:
    import functools

    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    import shardspeed
    from shardspeed.checkpointing import non_reentrant_checkpoint
    from shardspeed.pipe import PipelineModule

    shardspeed.init_distributed()
    out = {}
    mixed = [nn.ReLU() for _ in range(4)] + [nn.Linear(4, 4) for _ in range(4)]
    counted = _counting(non_reentrant_checkpoint)
    model = PipelineModule(
        mixed, num_stages=1, activation_checkpoint_interval=4, activation_checkpoint_func=counted
    )
    out["runs_4"] = model.is_checkpointable_results  # the ReLU run has no parameters
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    out["calls_4"] = counted.count
    model.set_checkpoint_interval(1)
    out["runs_1"] = model.is_checkpointable_results  # rebuilt for the new interval, not appended to
    counted.count = 0
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    out["calls_1"] = counted.count
    try:
        model.set_checkpoint_interval(-1)
    except ValueError as error:
        out["negative"] = str(error)

    def build(function):
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU()]
        return PipelineModule(
            layers, num_stages=1, loss_fn=nn.functional.mse_loss, activation_checkpoint_func=function
        )

    # use_reentrant: false replaces the module's function; the interval is off until the setter turns it on
    engine, *_ = shardspeed.initialize(
        model=build(None),
        config=dict(CONFIG, pipeline={"activation_checkpoint_interval": 0, "use_reentrant": False}),
    )
    out["non_reentrant_func"] = engine.module.activation_checkpoint_func is non_reentrant_checkpoint
    engine.module.set_checkpoint_interval(1)
    out["non_reentrant_predicate"] = engine._reentrant_activation_checkpointing()

    # a reentrant function: off while the interval is 0, on after the setter; the first stage's inputs then
    # require grad, so the first checkpointed run still gets its gradients (the same step as non-reentrant)
    firsts = {}
    for name, function in (
        ("reentrant", functools.partial(torch_checkpoint, use_reentrant=True)),
        ("plain", None),
    ):
        engine, *_ = shardspeed.initialize(model=build(function), config=CONFIG)
        if name == "reentrant":
            out["reentrant_before"] = engine._reentrant_activation_checkpointing()
        engine.module.set_checkpoint_interval(2)
        if name == "reentrant":
            out["reentrant_after"] = engine._reentrant_activation_checkpointing()
        first = engine.module.local_layers()[0][1].weight
        start = first.detach().clone()
        batch = (torch.linspace(-1, 1, 8).reshape(2, 4), torch.ones(2, 4))
        engine.train_batch(iter([batch]))
        firsts[name] = (start, first.detach().clone())
    out["first_layer_moved"] = not torch.equal(*firsts["reentrant"])
    out["same_step"] = torch.equal(firsts["reentrant"][1], firsts["plain"][1])
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(checkpoint_job, 1)[0]


def test_checkpointable_runs_are_cached_per_interval(results):
    assert results["runs_4"] == [False, True]
    assert results["calls_4"] == 1  # only the run with parameters is checkpointed
    assert results["runs_1"] == [False] * 4 + [True] * 4
    assert results["calls_1"] == 4
    assert "interval must be >= 0, got -1" in results["negative"]


def test_reentrant_choice_follows_the_module(results):
    assert results["non_reentrant_func"] and results["non_reentrant_predicate"] is False
    assert results["reentrant_before"] is False and results["reentrant_after"] is True
    assert results["first_layer_moved"] and results["same_step"]
