"""FairScale's FullyShardedDataParallel (shardspeed/fairscale/fsdp.py) on 2 Gloo ranks against single-process
training: flat and unflattened parameters, nesting and auto_wrap, mixed precision, host shards, no_sync,
clipping, the full and local state dicts, summon_full_params."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.fairscale.fsdp import FullyShardedDataParallel as FSDP
from shardspeed.fairscale.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap
from tests import fairscale_common as fc
from tests.harness import error_text, run_ranks

STEPS = 3
UNWRAPPED_NAMES = [n for n, _ in fc.model().named_parameters()]


def _train(model, optimizer, rank, world, micro=1, clip=None):
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = fc.batch(step)
        x, y = fc.local(x, rank, world), fc.local(y, rank, world)
        for m in range(micro):
            context = model.no_sync() if m < micro - 1 else torch.enable_grad()
            with context:
                (fc.loss_of(model, fc.local(x, m, micro), fc.local(y, m, micro)).float() / micro).backward()
        if clip is not None:
            norms.append(model.clip_grad_norm_(clip).item())
        optimizer.step()
    return norms


def _run(model, rank, world, optim=torch.optim.Adam, **train):
    optimizer = optim(model.parameters(), lr=0.01)
    norms = _train(model, optimizer, rank, world, **train)
    with model.summon_full_params():
        names = [n for n, _ in model.named_parameters()]
    return {"state": model.state_dict(), "names": names, "norms": norms}


def _ranks_body() -> dict:
    rank, world = fc.init_gloo()
    out = {"flat": _run(FSDP(fc.model()), rank, world)}
    net = fc.model()
    net[2] = FSDP(net[2], flatten_parameters=False, reshard_after_forward=False)
    out["nested"] = _run(FSDP(net, flatten_parameters=False, disable_reshard_on_root=False), rank, world)
    with enable_wrap(wrapper_cls=FSDP, move_params_to_cpu=True):
        policy = lambda **kw: default_auto_wrap_policy(**kw, min_num_params=100)  # noqa: E731
        model = auto_wrap(fc.model(), auto_wrap_policy=policy)
        model = wrap(model)
    out["auto_wrapped_instances"] = sum(isinstance(m, FSDP) for m in model.modules())
    out["auto"] = _run(model, rank, world, optim=torch.optim.SGD)
    out["no_sync_clip"] = _run(FSDP(fc.model(), cpu_offload=True), rank, world, micro=2, clip=0.05)
    mixed = FSDP(fc.model(), mixed_precision=True, compute_dtype=torch.bfloat16)
    out["mixed"] = _run(mixed, rank, world, optim=torch.optim.SGD)
    # local state dict round trip, full state dict load, summon write-back
    model = FSDP(fc.model())
    local = model.local_state_dict()
    out["local_keys"] = sorted(local)
    fresh = FSDP(fc.model(seed=5))
    fresh.load_local_state_dict(local)
    out["local_round_trip"] = fc.max_diff(fresh.state_dict(), fc.model().state_dict())
    other = FSDP(fc.model(seed=7))
    other.load_state_dict(fc.model().state_dict())
    out["full_load"] = fc.max_diff(other.state_dict(), fc.model().state_dict())
    with model.summon_full_params():
        model.module_root[0].weight.data.fill_(0.5)
    out["written_back"] = model.state_dict()["0.weight"]
    with model.summon_full_params(volatile=True):
        model.module_root[2].weight.data.fill_(0.5)
    out["volatile"] = model.state_dict()["2.weight"]
    out["refused"] = error_text(lambda: FSDP(fc.model(), state_dict_on_rank_0_only=True))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_ranks_body, fc.WORLD)


@pytest.mark.parametrize("case", ["flat", "nested"])
def test_fsdp_reaches_single_process_parameters_under_unwrapped_names(results, case):
    expected = fc.reference(torch.optim.Adam, STEPS, lr=0.01)
    for rank in results:
        assert fc.max_diff(rank[case]["state"], expected) < 1e-5
        assert rank[case]["names"] == UNWRAPPED_NAMES


def test_auto_wrap_nests_instances_and_trains_with_any_optimizer(results):
    assert results[0]["auto_wrapped_instances"] == 3  # the two Linear layers over 100 parameters, the root
    expected = fc.reference(torch.optim.SGD, STEPS, lr=0.01)
    for rank in results:
        assert fc.max_diff(rank["auto"]["state"], expected) < 1e-5
        assert rank["auto"]["names"] == UNWRAPPED_NAMES


def test_no_sync_and_clip_grad_norm_match_the_reference(results):
    net = fc.model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        fc.loss_of(net, *fc.batch(step)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).item())
        optimizer.step()
    for rank in results:
        assert fc.max_diff(rank["no_sync_clip"]["state"], net.state_dict()) < 1e-5
        assert rank["no_sync_clip"]["norms"] == pytest.approx(norms, rel=1e-5)


def test_mixed_precision_keeps_fp32_state_close_to_the_reference(results):
    expected = fc.reference(torch.optim.SGD, STEPS, lr=0.01)
    for rank in results:
        state = rank["mixed"]["state"]
        assert all(v.dtype == torch.float32 for v in state.values())
        assert 0 < fc.max_diff(state, expected) < 1e-3  # bf16 compute, fp32 shards: close, not equal


def test_state_dicts_and_summon_write_back(results):
    rank0 = results[0]
    assert rank0["local_keys"] == ["_fsdp_wrapped_module.flat_param_0"]
    assert rank0["local_round_trip"] == 0.0 and rank0["full_load"] == 0.0
    assert torch.equal(rank0["written_back"], torch.full_like(rank0["written_back"], 0.5))
    assert torch.equal(rank0["volatile"], fc.model()[2].weight.detach())
    assert "state_dict_on_rank_0_only" in rank0["refused"]


def test_wrap_outside_enable_wrap_returns_the_module():
    layer = nn.Linear(2, 2)
    assert wrap(layer) is layer and auto_wrap(layer) is layer


def test_a_bucket_size_that_would_be_ignored_is_refused_by_name():
    with pytest.raises(ValueError, match="bucket_cap_mb=100"):
        FSDP(nn.Linear(2, 2), bucket_cap_mb=100)
