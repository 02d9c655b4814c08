"""ZeRO-3 with parameters used outside the module that owns them: one the root module's forward reads itself
after the owning child ran (a tied output projection written as `F.linear(x, self.embed.weight)`), and one a
module returns from its forward for its caller to use (`return out, self.bias`, DeepSpeed's
test_zero_context_return). The unit is gathered for the module that uses it, and training matches one process
without ZeRO."""

import copy
import types

import pytest
import torch
from torch import nn

from harness import run_ranks

STEPS = 4


class ExternalUse(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        hidden = self.linear2(self.linear1(x))
        return nn.functional.linear(hidden, self.linear1.weight).pow(2).mean()  # linear1 has finished


class ReturnsBias(nn.Linear):
    def forward(self, x):
        return super().forward(x), self.bias  # the caller adds the bias again after this module has ended


class Middle(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.inner = ReturnsBias(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))  # a unit of its own: `middle` is hooked too

    def forward(self, x):
        out, bias = self.inner(x)
        return out * self.scale, bias  # passed on again: the outermost user is the one that must hold it


class ReturnedUse(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.linear1, self.middle = nn.Linear(dim, dim), Middle(dim)

    def forward(self, x):
        out, bias = self.middle(self.linear1(x))
        return (out + bias).pow(2).mean()


MODELS = {"read-by-root": ExternalUse, "returned-from-forward": ReturnedUse}


def _data():
    return torch.randn(
        STEPS, 2, 4, 16, generator=torch.Generator().manual_seed(1)
    )  # [step, rank, batch, dim]


def _train(model_name: str) -> dict:
    import torch.distributed as dist

    import shardspeed

    torch.manual_seed(0)
    model = MODELS[model_name]()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for batch in _data():
        loss = engine(batch[dist.get_rank()])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    external = {n: sorted(p.ds_id for p in m._external_params.values()) for n, m in model.named_modules()}
    return {
        "losses": losses,
        "params": params,
        "external": external,
        "bias_id": model.middle.inner.bias.ds_id if model_name == "returned-from-forward" else None,
    }


@pytest.mark.parametrize("model_name", list(MODELS))
def test_a_parameter_used_outside_its_module_trains_like_one_process(model_name):
    torch.manual_seed(0)
    reference = MODELS[model_name]()
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for batch in _data():  # the mean over both ranks' samples = the average of their gradients
        loss = (reference(batch[0]) + reference(batch[1])) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    results = run_ranks(_train, 2, model_name)
    for result in results:
        for name, value in reference.named_parameters():
            assert torch.allclose(result["params"][name], value.detach(), atol=1e-6), name
        for name, value in reference.named_parameters():  # allclose broadcasts: the shapes, separately
            assert result["params"][name].shape == value.shape, name
        if model_name == "returned-from-forward":
            # As DeepSpeed: registered with the module that uses it (the root), not with `middle`, which only
            # passes it on.
            expected = {name: [] for name in result["external"]}
            expected[""] = [result["bias_id"]]
            assert result["external"] == expected, result["external"]


class LateHead(nn.Module):
    """Two layers; a head attached after `initialize` that shares `linear1`'s weight (a tied output layer)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        hidden = self.linear2(self.linear1(x))
        head = getattr(self, "head", None)
        return (head(hidden) if head is not None else hidden).pow(2).mean()


def _tie_head(model: LateHead) -> None:
    head = nn.Linear(16, 16, bias=False)
    head.weight = model.linear1.weight  # a partitioned parameter under ZeRO-3: empty until gathered
    head._parameters = dict(head._parameters)  # torch's own container, whatever this torch's default is
    model.head = head


def _train_late_head() -> dict:
    import torch.distributed as dist

    import shardspeed
    from shardspeed.zero.parameter_dict import ZeROOrderedDict

    torch.manual_seed(0)
    model = LateHead()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    containers = {n: m._parameters for n, m in model.named_modules()}
    _tie_head(model)
    losses = []
    for batch in _data():
        loss = engine(batch[dist.get_rank()])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "params": params,
        "late_converted": isinstance(model.head._parameters, ZeROOrderedDict),
        "kept": all(m._parameters is containers[n] for n, m in model.named_modules() if n in containers),
        "all_converted": all(isinstance(c, ZeROOrderedDict) for c in containers.values()),
    }


def test_a_module_attached_after_initialize_gathers_the_parameters_it_reads():
    torch.manual_seed(0)
    reference = LateHead()
    _tie_head(reference)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for batch in _data():
        loss = (reference(batch[0]) + reference(batch[1])) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for result in run_ranks(_train_late_head, 2):
        assert result["all_converted"] and result["late_converted"] and result["kept"]
        for name, value in reference.named_parameters():
            assert result["params"][name].shape == value.shape, name
            assert torch.allclose(result["params"][name], value.detach(), atol=1e-6), name


def test_ensure_zero_ordered_dict_converts_once_and_keeps_the_first_container():
    from shardspeed.zero.parameter_dict import ZeROOrderedDict, ensure_zero_ordered_dict

    layer = nn.Linear(4, 4)
    first = layer._parameters
    ensure_zero_ordered_dict(layer)
    converted = layer._parameters
    assert isinstance(converted, ZeROOrderedDict) and list(converted) == ["weight", "bias"]
    assert layer._original_parameters is first and layer.weight is first["weight"]
    ensure_zero_ordered_dict(layer)
    assert layer._parameters is converted  # idempotent
    layer._parameters = dict(converted)  # replaced again by someone: converted, the first original kept
    ensure_zero_ordered_dict(layer)
    assert isinstance(layer._parameters, ZeROOrderedDict) and layer._original_parameters is first
    bare = types.SimpleNamespace(_parameters=None)
    ensure_zero_ordered_dict(bare)  # nothing to convert: left as it is
    assert bare._parameters is None and not hasattr(bare, "_original_parameters")
    copied = copy.deepcopy(layer)  # a copy is not part of a running model: no coordinator comes with it
    assert isinstance(copied._parameters, ZeROOrderedDict) and copied._parameters.coordinators == []
    assert copied._parameters._parent_module is copied and torch.equal(copied.weight, layer.weight)
