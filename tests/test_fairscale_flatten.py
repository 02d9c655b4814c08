"""FairScale's FlattenParamsWrapper (shardspeed/fairscale/flatten_params.py), in one process: the wrapped model
computes, trains and saves as the unwrapped one, under the unwrapped model's names."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardspeed.fairscale.flatten_params import FlattenParamsWrapper


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 4))
    model.register_buffer("steps", torch.tensor(3.0))
    return model


def _shared(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))
    model[3].weight = model[1].weight  # one parameter under two names
    return model


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    x = torch.randn(5, 4)
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_wrapped_model_trains_as_the_unwrapped_one_and_saves_under_its_names():
    reference, wrapped = _model(), FlattenParamsWrapper(_model())
    assert [n for n, _ in wrapped.named_parameters()] == ["flat_param_0"]
    assert wrapped.flat_param.numel() == sum(p.numel() for p in reference.parameters())
    assert len(list(wrapped[0][0].parameters())) == 0  # unregistered from their modules
    assert _train(wrapped) == _train(reference)
    ours, theirs = wrapped.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_a_shared_parameter_is_packed_once_and_stays_shared():
    reference, wrapped = _shared(), FlattenParamsWrapper(_shared())
    assert wrapped.flat_param.numel() == sum(p.numel() for p in reference.parameters())
    assert _train(wrapped) == pytest.approx(_train(reference), abs=1e-7)
    state = wrapped.state_dict()
    assert torch.equal(state["3.weight"], state["1.weight"])
    assert torch.equal(state["3.weight"], reference.state_dict()["3.weight"])


def test_groups_names_and_partial_packing():
    model = _model()
    groups = [list(model[0].parameters()), [model[1].weight]]
    wrapped = FlattenParamsWrapper(model, param_list=groups, flat_param_names=["body", "head"])
    assert [n for n, _ in wrapped.named_parameters()] == [
        "flat_param_body",
        "flat_param_head",
        "_fpw_module.1.bias",
    ]
    assert [f.numel() for f in wrapped.flat_params] == [4 * 8 + 8 + 8 * 8 + 8, 8 * 4]
    with pytest.raises(RuntimeError, match="2 flat parameters"):
        _ = wrapped.flat_param
    assert list(wrapped.state_dict()) == list(_model().state_dict())
    nothing = FlattenParamsWrapper(_model(), param_list=[[]])
    assert nothing.flat_params == [] and list(nothing.state_dict()) == list(_model().state_dict())


def test_state_dicts_round_trip_flat_and_unflattened_also_nested():
    source = FlattenParamsWrapper(_model(seed=0))
    _train(source)
    x = torch.randn(2, 4)
    expected = source(x)
    for state in (source.state_dict(), source.flat_state_dict()):
        target = FlattenParamsWrapper(_model(seed=7))
        target.load_state_dict(state)
        assert torch.equal(target(x), expected)
    assert "flat_param_0" in source.flat_state_dict() and "_fpw_module.steps" in source.flat_state_dict()
    # inside a parent module: torch recurses into the wrapper's hooks with the parent's prefix
    parent = nn.Sequential(FlattenParamsWrapper(_model(seed=0)))
    keys = list(parent.state_dict())
    assert keys == ["0." + k for k in _model().state_dict()]
    other = nn.Sequential(FlattenParamsWrapper(_model(seed=5)))
    other.load_state_dict(parent.state_dict())
    assert torch.equal(other(x), parent(x))


def test_unflatten_params_shows_the_originals_and_external_values_are_not_kept():
    wrapped = FlattenParamsWrapper(_model())
    before = wrapped.flat_param.detach().clone()
    with wrapped.unflatten_params():
        names = [n for n, _ in wrapped.named_parameters()]
        assert names == ["_fpw_module." + n for n, _ in _model().named_parameters()]
        wrapped[1].bias.data.fill_(0.5)  # an edit inside reaches the flat parameter
    assert torch.all(wrapped.state_dict()["1.bias"] == 0.5)
    outside = [torch.full_like(wrapped.flat_param, 42.0)]
    with wrapped.unflatten_params(flat_params=outside):
        assert torch.all(wrapped.state_dict()["0.0.weight"] == 42.0)
    assert not torch.all(wrapped.flat_param == 42.0)
    assert torch.equal(wrapped.flat_param[: before.numel() - 4], before[: before.numel() - 4])
    with (
        pytest.raises(ValueError, match="one tensor per flat parameter"),
        wrapped.unflatten_params([torch.zeros(3)]),
    ):
        pass


def test_dtype_changes_follow_and_bad_groups_are_refused():
    wrapped = FlattenParamsWrapper(_model()).to(torch.float64)
    assert wrapped.flat_param.dtype == torch.float64
    assert wrapped(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64
    model = _model()
    with pytest.raises(ValueError, match="in two groups"):
        FlattenParamsWrapper(model, param_list=[[model[1].weight], [model[1].weight]])
    with pytest.raises(ValueError, match="not one of the module's"):
        FlattenParamsWrapper(model, param_list=[nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="one distinct name"):
        FlattenParamsWrapper(copy.deepcopy(model), flat_param_names=["a", "b"])
