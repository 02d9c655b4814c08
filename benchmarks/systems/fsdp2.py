"""torch FSDP2 (`fully_shard`, stage-3 analogue): one unit per block, then the root; reshard after forward."""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.models import clip_gradients, make_optimizer, shard_units
from benchmarks.systems.base import BuildContext, Trainer


def build(ctx: BuildContext) -> Trainer:
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = ctx.model
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    optimizer = make_optimizer(params, ctx.hyper)

    def backward(batch):
        loss = model(batch)
        loss.backward()
        return loss

    def step():
        clip_gradients(params, ctx.hyper)  # over DTensor shards: torch all-reduces the norm
        optimizer.step()
        optimizer.zero_grad()

    return Trainer(backward, step, state_roots=[model, optimizer])
