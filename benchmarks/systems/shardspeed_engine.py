"""shardspeed at ZeRO stages 0-3 (and the optimizer-offload variant), through `initialize` as a user calls it.

A stage the library does not implement yet raises `shardspeed.ConfigError`; that becomes a "not implemented
yet" row, so re-running the harness fills the row in once the stage lands.

`shardspeed` is imported inside the rank, not here: the `baseline-z*` rows run the same code against another
checkout of the library (`run.py --baseline-tree`), which the rank puts first on its path before this import.
"""

from __future__ import annotations

from benchmarks.models import make_optimizer
from benchmarks.systems.base import BuildContext, SystemUnavailable, Trainer
from benchmarks.systems.engine_api import engine_config, engine_trainer


def _build(ctx: BuildContext, offload: bool) -> Trainer:
    import shardspeed

    optimizer = make_optimizer(ctx.model.parameters(), ctx.hyper)
    try:
        engine, _, _, _ = shardspeed.initialize(
            model=ctx.model, optimizer=optimizer, config=engine_config(ctx, offload)
        )
    except shardspeed.ConfigError as err:
        if "not implemented" in str(err) or "not supported" in str(err):
            raise SystemUnavailable(f"not implemented yet ({err})") from err
        raise
    return engine_trainer(engine)


def build(ctx: BuildContext) -> Trainer:
    return _build(ctx, offload=False)


def build_offload(ctx: BuildContext) -> Trainer:
    return _build(ctx, offload=True)
