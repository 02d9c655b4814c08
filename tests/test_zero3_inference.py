"""ZeRO-3 without an optimizer (evaluation only, as Hugging Face's inference path runs it): parameters stay
partitioned, each forward gathers them and gives the plain model's output; training calls are refused."""

import pytest
import torch
from torch import nn

from harness import error_text, run_ranks


class Reused(nn.Module):
    """A module called twice in one forward, as DeepSpeed's test model does."""

    def __init__(self, layers: int = 6, dim: int = 8):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.linears):
            x = self.linears[i // 2](x) + layer(x)
        return x


def _forward(under_init: bool) -> dict:
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    torch.manual_seed(0)
    if under_init:
        with shardspeed.zero.Init(config_dict_or_path=config):
            model = Reused()
    else:
        model = Reused()
    engine, *_ = shardspeed.initialize(model=model, config=config)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # evaluation: nothing is kept gathered for a backward
        out = engine(x)
    # (the unit released last stays gathered until the next gather needs room: one module at most)
    gathered = {name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.numel() > 0}
    out_with_grad = engine(x)  # a forward that records autograd works too
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"out": out, "gathered": gathered, "state": state, "out_with_grad": out_with_grad.detach(),
            "backward": error_text(lambda: engine.backward(out_with_grad.sum())),
            "step": error_text(engine.step)}  # fmt: skip


@pytest.mark.parametrize("under_init", [False, True], ids=["plain", "zero.Init"])
def test_zero3_without_an_optimizer_partitions_and_forwards_like_the_plain_model(under_init):
    for result in run_ranks(_forward, 2, under_init):
        reference = Reused()
        reference.load_state_dict(result["state"])
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(result["out"], reference(x).detach(), atol=1e-6)
        assert torch.equal(result["out_with_grad"], result["out"])
        assert len(result["gathered"]) <= 1  # partitioned outside the forward
        assert "needs an optimizer" in result["backward"] and "needs an optimizer" in result["step"]
