"""The DeepSpeed names integrations call, checked without the integrations installed (core suite).

Two ranks: `zero.GatheredParameters` over parameters `zero.Init` partitioned (HF initialises and loads
weights that way), and the ZeRO-3 engine's `_zero3_consolidated_16bit_state_dict` against the unsharded
model. In-process: `clone_tensors_for_torch_save`, `set_z3_leaf_modules`, `get_accelerator()`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.checkpoint.utils import clone_tensors_for_torch_save
from shardspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules

from harness import run_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _job() -> dict:
    import torch.distributed as dist

    import shardspeed
    from shardspeed import zero

    shardspeed.init_distributed()
    rank = dist.get_rank()
    out = {}
    with zero.Init():
        model = _net()
    weight = model[0].weight
    out["partitioned_numel"] = weight.numel()
    out["ds_numel"], out["ds_shape"] = weight.ds_numel, tuple(weight.ds_shape)
    with zero.GatheredParameters([weight], modifier_rank=0):
        out["gathered_shape"] = tuple(weight.shape)
        with torch.no_grad():
            weight.fill_(1.0 + rank)  # only rank 0's change counts
    with zero.GatheredParameters([weight]):
        out["after_modifier"] = weight.detach().clone()
        with torch.no_grad():
            weight.fill_(-5.0)  # no modifier_rank: discarded
    with zero.GatheredParameters([weight]):
        out["after_discard"] = weight.detach().clone()
    out["released_numel"] = weight.numel()

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    }
    engine, *_ = shardspeed.initialize(model=_net(), config=config)
    out["gather_on_save"] = engine.zero_gather_16bit_weights_on_model_save()
    out["state"] = engine._zero3_consolidated_16bit_state_dict()
    return out


def test_gathered_parameters_and_zero3_state_dict_on_two_ranks():
    results = run_ranks(_job, 2)
    full = _net().state_dict()
    for rank, out in enumerate(results):
        assert out["partitioned_numel"] == 0 and out["ds_numel"] == 60 and out["ds_shape"] == (10, 6)
        assert out["gathered_shape"] == (10, 6) and out["released_numel"] == 0
        assert torch.equal(out["after_modifier"], torch.ones(10, 6)), rank  # rank 0's value everywhere
        assert torch.equal(out["after_discard"], torch.ones(10, 6)), rank
        assert out["gather_on_save"] is True
    assert results[1]["state"] is None  # rank 0 only, as DeepSpeed
    state = results[0]["state"]
    assert sorted(state) == sorted(full)
    for name, value in full.items():
        assert torch.equal(state[name], value), name


def test_clone_tensors_for_torch_save_copies_views_and_keeps_structure():
    flat = torch.arange(6.0)
    item = {"a": flat[:2], "b": [flat[2:4], (flat[4:], 7)], "c": "text"}
    cloned = clone_tensors_for_torch_save(item)
    assert cloned["c"] == "text" and cloned["b"][1][1] == 7 and isinstance(cloned["b"][1], tuple)
    assert torch.equal(cloned["a"], flat[:2])
    assert cloned["a"].untyped_storage().nbytes() == 2 * 4  # its own storage, not the 6-element buffer
    flat.zero_()
    assert torch.equal(cloned["b"][0], torch.tensor([2.0, 3.0]))


def test_set_z3_leaf_modules_marks_by_class_or_name_and_refuses_unknowns():
    model = _net()
    assert set_z3_leaf_modules(model, [nn.Linear]) == [model[0], model[2]]
    assert get_z3_leaf_modules(model) == [model[0], model[2]]
    unset_z3_leaf_modules(model, ["Linear"])
    assert get_z3_leaf_modules(model) == []
    with pytest.raises(
        ValueError, match=r"no module of the classes \[<class 'torch.nn.modules.conv.Conv1d'>\]"
    ):
        set_z3_leaf_modules(model, [nn.Conv1d])
    with pytest.raises(ValueError, match="expected module classes or class names"):
        set_z3_leaf_modules(model, [3])


def test_get_accelerator_names_the_cpu_backend(monkeypatch):
    monkeypatch.setenv("SHARDSPEED_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available() and acc.device_count() == 1
    assert acc.memory_allocated() == 0 and acc.is_bf16_supported()
    acc.empty_cache()
    acc.synchronize()
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
