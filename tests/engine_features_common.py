"""Shared pieces of test_engine_features.py: a tiny model, its data, and a training loop over any config."""

from __future__ import annotations

import copy

import torch
from torch import nn

IN, HIDDEN = 8, 16


class MLP(nn.Module):
    """Linear / LayerNorm / Linear, the loss inside; returns the loss in the dtype the model computes in."""

    config_class = "MLPConfig"  # an attribute the engine forwards, as Transformers' models have

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)

    def forward(self, x):
        return (self.down(torch.relu(self.norm(self.up(x)))) ** 2).mean()

    def describe(self) -> str:
        return "a method of the model"


class AutocastMLP(MLP):
    """The MLP with torch.autocast opened by hand inside its forward: what `torch_autocast` should equal."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x)


class LeafyBlock(nn.Module):
    """Two linears: larger than the tests' unit size, so split in two units unless marked as a leaf."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(IN, IN), nn.Linear(IN, IN)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class LeafyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([LeafyBlock(), LeafyBlock()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return (x**2).mean()


def config(**overrides) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
    }
    for key, value in overrides.items():
        cfg[key] = (
            {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
        )
    return cfg


def make_engine(cfg: dict, model=MLP, **kwargs):
    """An engine over `model`: a module class (built here, after seeding, so every engine of a test starts
    from the same weights) or a module built by the caller (zero.Init)."""
    import shardspeed

    torch.manual_seed(0)
    model = model() if isinstance(model, type) else model
    engine, *_ = shardspeed.initialize(model=model, config=copy.deepcopy(cfg), **kwargs)
    return engine


def batches(engine, steps: int) -> torch.Tensor:
    """[steps, gas, micro, IN] inputs of this rank (each rank its own slice of the global batch)."""
    g = torch.Generator().manual_seed(7)
    world, micro, gas = (
        engine.world_size,
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )
    data = torch.randn(steps, gas, world, micro, IN, generator=g)
    return data[:, :, engine.dp_rank]


def train(engine, steps: int = 2, dtype=None) -> list[float]:
    losses = []
    for step_batches in batches(engine, steps):
        for x in step_batches:
            loss = engine(x.to(dtype) if dtype is not None else x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def params(engine) -> dict[str, torch.Tensor]:
    from shardspeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
