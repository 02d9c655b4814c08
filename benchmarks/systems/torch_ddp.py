"""torch's own data parallelism: DDP (stage-0 analogue) and ZeroRedundancyOptimizer + DDP (stage-1 analogue).

DDP keeps its gradient buckets in C++ (`gradient_as_bucket_view=False`, the default, copies gradients into
them), out of reach of the Python walk: their size, one copy of the parameters, is added as hidden bytes.
"""

from __future__ import annotations

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from benchmarks.models import Hyper, clip_gradients, make_optimizer
from benchmarks.systems.base import BuildContext, Trainer


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _trainer(ddp: DistributedDataParallel, optimizer, hyper: Hyper) -> Trainer:
    params = list(ddp.parameters())

    def backward(batch):
        loss = ddp(batch)
        loss.backward()
        return loss

    def step():
        clip_gradients(params, hyper)  # DDP's gradients are already averaged: a local norm is the global one
        optimizer.step()
        optimizer.zero_grad()

    return Trainer(backward, step, state_roots=[ddp, optimizer], hidden_state_bytes=_param_bytes(ddp))


def build_ddp(ctx: BuildContext) -> Trainer:
    ddp = DistributedDataParallel(ctx.model)
    return _trainer(ddp, make_optimizer(ddp.parameters(), ctx.hyper), ctx.hyper)


def build_zero_redundancy(ctx: BuildContext) -> Trainer:
    import torch

    ddp = DistributedDataParallel(ctx.model)
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.AdamW, **ctx.hyper.torch_kwargs()
    )
    return _trainer(ddp, optimizer, ctx.hyper)
