"""zero.Init builds a model already partitioned, with the values a normal construction gives."""

import torch
from torch import nn

from common import base_config, build_model, full_params, param_groups, params_of, train_engine
from harness import run_ranks
from models import TinyGPT, token_batches


class InitByApply(nn.Module):
    """Re-initialises every Linear through `apply` at the end of __init__ (the GPT-2 pattern)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)


def _construct(stage: int) -> dict:
    import torch.distributed as dist

    import shardspeed

    shardspeed.init_distributed()
    out = {}
    torch.manual_seed(0)
    with shardspeed.zero.Init():
        model = TinyGPT()
        by_apply = InitByApply()
    out["local_numel"] = sum(p.numel() for p in model.parameters())  # everything partitioned
    out["chunks"] = sum(p._zero_init_shard.numel() for p in model.parameters())
    out["apply_values"] = {
        n: shardspeed.core.partitioned.full_value(p).clone() for n, p in by_apply.named_parameters()
    }
    config = base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 3000,
                                            "stage3_param_persistence_threshold": 0})  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, config=config)
    out["initial"] = full_params(engine)
    data = token_batches(3, engine.train_batch_size())
    train_engine(engine, data, range(3), dist.get_rank(), dist.get_world_size())
    out["trained"] = full_params(engine)
    return out


def _normal(stage: int) -> dict:
    import torch.distributed as dist

    import shardspeed

    torch.manual_seed(0)
    model = build_model()
    config = base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 3000})
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=param_groups(model, False), config=config
    )
    out = {"initial": full_params(engine)}
    data = token_batches(3, engine.train_batch_size())
    train_engine(engine, data, range(3), dist.get_rank(), dist.get_world_size())
    out["trained"] = full_params(engine)
    return out


def test_init_partitions_and_matches_normal_construction():
    torch.manual_seed(0)
    TinyGPT()
    reference_apply = params_of(InitByApply())
    for stage in (3, 1):
        built = run_ranks(_construct, 2, stage)
        normal = run_ranks(_normal, 2, stage)[0]
        for rank in range(2):
            assert built[rank]["local_numel"] == 0
            full = sum(t.numel() for t in normal["initial"].values())
            assert built[rank]["chunks"] <= full // 2 + 64  # each rank holds about half
            for name, value in normal["initial"].items():
                assert torch.equal(built[rank]["initial"][name], value), name
            for name, value in normal["trained"].items():
                assert (built[rank]["trained"][name] - value).abs().max() <= 1e-6, name
            for name, value in reference_apply.items():
                assert torch.equal(built[rank]["apply_values"][name], value), name


def _init_over_a_group_made_too_early() -> dict:
    """A one-rank default group made before the launcher's (a library calling init_process_group on its own),
    while WORLD_SIZE says 2 processes were started."""
    import os
    import tempfile

    import torch.distributed as dist

    import shardspeed

    from harness import error_text

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    os.environ["WORLD_SIZE"] = "2"
    refused = error_text(lambda: shardspeed.zero.Init())
    # one rank chosen by the caller is intended: partitioned over it, no error
    with shardspeed.zero.Init(data_parallel_group=dist.new_group([0])):
        layer = nn.Linear(4, 4)
    os.environ["WORLD_SIZE"] = "1"
    with shardspeed.zero.Init():  # a genuine one-process run
        single = nn.Linear(4, 4)
    return {"refused": refused, "explicit": layer.weight.ds_numel, "single": single.weight.ds_numel}


def test_init_refuses_a_one_rank_group_under_a_multi_process_launcher():
    from shardspeed.zero.init import contradicting_single_rank_group_error as check

    out = run_ranks(_init_over_a_group_made_too_early, 1)[0]
    assert out["refused"].startswith(
        "RuntimeError: zero.Init would partition parameters over a process group of 1"
    )
    assert "WORLD_SIZE=2" in out["refused"] and "init_distributed" in out["refused"]
    assert out["explicit"] == out["single"] == 16
    # the rule itself: only the default group, only when the launcher's WORLD_SIZE is a number above 1
    assert check(1, None, {"WORLD_SIZE": "8"}) is not None
    assert check(8, None, {"WORLD_SIZE": "8"}) is None
    assert check(1, object(), {"WORLD_SIZE": "8"}) is None
    for env in ({}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": ""}, {"WORLD_SIZE": "x"}, {"WORLD_SIZE": None}):
        assert check(1, None, env) is None, env
