"""The compute limit: one process doing one rank's work (same micro-batch), plain torch AdamW, no communication."""

from __future__ import annotations

from benchmarks.models import clip_gradients, make_optimizer
from benchmarks.systems.base import BuildContext, Trainer


def build(ctx: BuildContext) -> Trainer:
    model = ctx.model
    params = list(model.parameters())
    optimizer = make_optimizer(params, ctx.hyper)

    def backward(batch):
        loss = model(batch)
        loss.backward()
        return loss

    def step():
        clip_gradients(params, ctx.hyper)
        optimizer.step()
        optimizer.zero_grad()

    return Trainer(backward, step, state_roots=[model, optimizer])
