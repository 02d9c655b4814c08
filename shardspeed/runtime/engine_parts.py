"""The engine's checkpoint parts (checkpoint/parts.py): which parts a `ShardspeedEngine` saves and loads, in
which order, and the training counters, the one piece of state the engine itself holds.

Order (the save and load order): the module and optimizer wrapper (`ModelStates`, or MoE's subclass, or
the pipeline's), the tensor layout, ZenFlow's state (zero/zenflow/part.py), the LR scheduler, the
compression schedule, the data sampler (the curriculum sampler's state when curriculum sampling is on), the random-LTD and legacy curriculum schedulers, the
counters, the config record, the RNG streams. A part added to the list is saved and loaded without the
checkpoint code knowing it. `weights_source` says the same parts' story to the 16-bit export.
"""

from __future__ import annotations

from shardspeed.checkpoint.export import WeightsSource
from shardspeed.checkpoint.model_states import ModelStates
from shardspeed.checkpoint.parts import ConfigRecord, LoadContext, NamedState, Part, Placement, SaveOptions
from shardspeed.checkpoint.rng import RngStates
from shardspeed.checkpoint.tensor_parallel import TensorParallelState
from shardspeed.moe.checkpoint import MoEModelStates
from shardspeed.runtime.data import sampler_state
from shardspeed.version import __version__
from shardspeed.zero.zenflow import zenflow_parts

__all__ = ["TrainingCounters", "checkpoint_parts", "model_part", "placement", "weights_source"]


class TrainingCounters(Part):
    """`global_steps`, `global_samples`, `skipped_steps`, `micro_steps` of the engine."""

    name = "counters"
    keys = ("global_steps", "global_samples", "skipped_steps", "micro_steps")

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self, options: SaveOptions) -> dict:
        e = self.engine
        return {
            "global_steps": e.global_steps,
            "global_samples": e.global_samples,
            "skipped_steps": e.skipped_steps,
            "micro_steps": e.micro_steps,
        }

    def load_state_dict(self, entries: dict, ctx: LoadContext) -> None:
        e = self.engine
        e.global_steps = entries["global_steps"]
        e.global_samples = entries.get("global_samples", e.global_steps * e.train_batch_size())
        e.skipped_steps = entries["skipped_steps"]
        gas = e.gradient_accumulation_steps()
        e.micro_steps = entries.get("micro_steps", e.global_steps * gas)
        if ctx.resharded and e.micro_steps % gas:
            # Resharded with another accumulation count (the same global batch over another world size):
            # start the next accumulation window at its beginning, as the saved run would have.
            e.micro_steps = e.global_steps * gas


def placement(engine, mp_rank: int | None = None) -> Placement:
    """The engine's place for checkpoint files; `mp_rank` defaults to its tensor rank."""
    tp = getattr(engine, "tensor_parallel", None)
    return Placement(
        device=engine.device,
        global_rank=engine.global_rank,
        dp_rank=engine.dp_rank,
        dp_world_size=engine.world_size,
        mp_rank=mp_rank if mp_rank is not None else (tp.rank if tp is not None else 0),
    )


def model_part(engine, cls=None, **extra) -> ModelStates:
    """The part holding the module and the optimizer wrapper: MoE's when the model has MoE layers."""
    if cls is None:
        cls = MoEModelStates if getattr(engine, "moe", None) is not None else ModelStates
    if cls is MoEModelStates:
        extra["moe"] = engine.moe
        if engine._config.zero_optimization.pipeline_loading_checkpoint:
            raise NotImplementedError(
                "zero_optimization.pipeline_loading_checkpoint: loading in turns is not built for models with MoE "
                "layers (their experts load from per-expert files); remove the key"
            )
    return cls(
        engine.module,
        engine.optimizer,
        engine._checkpoint_placement(),
        zero_stage=engine.zero_optimization_stage(),
        tp=getattr(engine, "tensor_parallel", None),
        ds_config=engine.config,
        version=__version__,
        load_in_turns=engine._config.zero_optimization.pipeline_loading_checkpoint,
        **extra,
    )


def checkpoint_parts(engine) -> list:
    return [
        model_part(engine),
        TensorParallelState(getattr(engine, "tensor_parallel", None)),
        *zenflow_parts(engine.optimizer),  # ZenFlow's selection, moments and accumulator, per rank
        NamedState("lr_scheduler", engine.lr_scheduler, scheduler=True),
        engine.compression.checkpoint_part(),
        sampler_state(engine.training_dataloader),
        *engine.data_efficiency.checkpoint_parts(),  # random_ltd, curriculum_scheduler_legacy
        TrainingCounters(engine),
        ConfigRecord(engine.config, __version__),
        RngStates(),
    ]


def weights_source(engine) -> WeightsSource:
    """Where the engine's weights are, for `save_16bit_model` and the consolidated 16-bit state dict."""
    tp, moe = getattr(engine, "tensor_parallel", None), getattr(engine, "moe", None)
    return WeightsSource(
        module=engine.module,
        stage3_units=engine.optimizer.coordinator.units if engine.zero_optimization_stage() == 3 else None,
        tp_group=tp.group if tp is not None else None,
        experts_split=moe is not None and any(layer.ep_size > 1 for layer in moe.layers),
        gather_on_save=engine._config.zero_optimization.stage3_gather_16bit_weights_on_model_save,
    )
