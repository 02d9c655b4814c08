"""Stage 3 frees a unit's gathered parameters after its forward even though autograd saved views of them.

`nn.Linear` saves `weight.t()` for its backward: a view that keeps its storage alive. Were each gather a
fresh buffer, every unit gathered in forward would stay in memory until its backward (the whole model at
the end of forward). Here the storages autograd saved are measured right after forward: only the last,
lingering unit may still be full. The step after must still train exactly like plain PyTorch.
"""

import torch
from torch import nn

from harness import run_ranks

WIDTH, LAYERS, LR = 96, 6, 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _data() -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))


def _reference() -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(2):
        model(_data()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _saved_bytes_after_forward(world: int) -> dict:
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_allow_untested_optimizer": True,  # SGD is elementwise
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
    }
    engine, *_ = shardspeed.initialize(model=_model(), config=config)
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    sizes = []
    for _ in range(2):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = engine(_data()).square().mean()
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved}
        sizes.append(sum(storages.values()))
        engine.backward(loss)
        engine.step()
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    del world
    return {"saved_bytes": sizes, "params": params}


def test_forward_keeps_only_the_last_unit_gathered_and_training_is_exact():
    world = 2
    unit_bytes = (WIDTH * WIDTH + WIDTH) * 4
    activations = (LAYERS + 1) * 8 * WIDTH * 4  # each layer's input, and the output that square() saves
    reference = _reference()
    for rank in run_ranks(_saved_bytes_after_forward, world, world):
        for measured in rank["saved_bytes"]:
            # One lingering unit plus activations; holding every unit's buffer would be 6 x unit_bytes.
            assert measured <= unit_bytes + activations, rank["saved_bytes"]
        for name, value in reference.items():
            assert torch.allclose(rank["params"][name], value, atol=1e-6), name
