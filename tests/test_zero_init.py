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
