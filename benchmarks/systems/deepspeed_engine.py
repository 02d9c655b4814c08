"""DeepSpeed 0.19.8 at ZeRO stages 0-3 on CPU (`DS_ACCELERATOR=cpu`, Gloo): the anchor we compare against.

Optional: only imported inside the spawned ranks of a DeepSpeed row, and only when installed (the `bench`
extra). The process group is already initialized by the harness; DeepSpeed adopts it.
"""

from __future__ import annotations

import importlib.util
import logging

from benchmarks.models import make_optimizer
from benchmarks.systems.base import BuildContext, Trainer
from benchmarks.systems.engine_api import engine_config, engine_trainer

ENV = (("DS_ACCELERATOR", "cpu"),)


def unavailable() -> str | None:
    return None if importlib.util.find_spec("deepspeed") is not None else "deepspeed not installed"


def build(ctx: BuildContext) -> Trainer:
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    optimizer = make_optimizer(ctx.model.parameters(), ctx.hyper)
    engine, _, _, _ = deepspeed.initialize(model=ctx.model, optimizer=optimizer, config=engine_config(ctx))
    return engine_trainer(engine)
