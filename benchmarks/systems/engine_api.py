"""What shardspeed and DeepSpeed share: one JSON config and one engine loop (`engine(batch)`, `backward`, `step`)."""

from __future__ import annotations

from benchmarks.systems.base import BuildContext, Trainer


def engine_config(ctx: BuildContext, offload: bool = False) -> dict:
    """The DeepSpeed config both engines get: fp32, no accumulation, no progress prints.

    `gradient_clipping` is explicit (the run's `max_grad_norm`, 0 by default): both engines default it to
    1.0 as DeepSpeed 0.19.8 does, and the torch systems clip only when the run asks them to, so leaving it
    out would make the engines' losses drift from everyone else's.
    """
    zero: dict = {"stage": ctx.zero_stage}
    if ctx.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = ctx.reduce_bucket_size
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": ctx.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "gradient_clipping": ctx.hyper.max_grad_norm,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }


def engine_trainer(engine) -> Trainer:
    """A `Trainer` driving a DeepSpeed-API engine; model states live in the engine and its optimizer."""

    def backward(batch):
        loss = engine(batch)
        engine.backward(loss)
        return loss

    return Trainer(backward, engine.step, state_roots=[engine, engine.optimizer])
