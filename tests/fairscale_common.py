"""Shared pieces of the FairScale API tests: a small model, data, and the single-process reference runs.

Each rank trains on its half of every batch; the reference trains one process on the whole batch with the
same torch optimizer, so with mean losses the two must reach the same parameters (fp32: 1e-5).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
BATCH = 8  # whole batch; each rank takes BATCH // WORLD rows


def init_gloo() -> tuple[int, int]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def local(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tensor.shape[0] // world
    return tensor[rank * per : (rank + 1) * per]


def loss_of(net, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(net(x), y)


def reference(optim_cls, steps: int, clip: float | None = None, **kwargs) -> dict[str, torch.Tensor]:
    """Single-process training on the whole batches: the parameters parallel runs must reach."""
    net = model()
    opt = optim_cls(net.parameters(), **kwargs)
    for step in range(steps):
        opt.zero_grad()
        loss_of(net, *batch(step)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def cpu_threads() -> None:
    torch.set_num_threads(int(os.environ.get("SHARDSPEED_TEST_THREADS", "1")))
