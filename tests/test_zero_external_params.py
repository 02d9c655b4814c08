"""ZeRO-3 with a parameter the root module's forward reads itself after the owning child ran (a tied output
projection written as `F.linear(x, self.embed.weight)`): the unit is gathered for the root, and training
matches one process without ZeRO."""

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


def _data():
    return torch.randn(
        STEPS, 2, 4, 16, generator=torch.Generator().manual_seed(1)
    )  # [step, rank, batch, dim]


def _train(_: int) -> dict:
    import torch.distributed as dist

    import shardspeed

    torch.manual_seed(0)
    model = ExternalUse()
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
    return {"losses": losses, "params": params}


def test_root_reading_a_finished_childs_weight_trains_like_one_process():
    torch.manual_seed(0)
    reference = ExternalUse()
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for batch in _data():  # the mean over both ranks' samples = the average of their gradients
        loss = (reference(batch[0]) + reference(batch[1])) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    results = run_ranks(_train, 2, 0)
    for result in results:
        for name, value in reference.named_parameters():
            assert torch.allclose(result["params"][name], value.detach(), atol=1e-6), name
    assert all(r["params"]["linear1.weight"].shape == (16, 16) for r in results)
