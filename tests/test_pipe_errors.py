"""Pipeline misuse gets errors naming the problem, and an fp16 overflow on one stage skips the step on all."""

import pytest
from pipe_common import BASE_SEED, Tripwire, global_batches, layer_specs, loss_fn, replica_iterator

from shardspeed.pipe.partition import PartitionError, balanced_bounds, partition_layers, uniform_bounds
from shardspeed.pipe.schedule import (
    BackwardPass,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

from harness import error_text, run_ranks

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "steps_per_print": 1000,
}


def pipeline_job():
    """Both checks in one process group (process start-up dominates their cost)."""
    import shardspeed

    shardspeed.init_distributed()
    return misuse(), overflow()


def misuse() -> dict:
    import torch

    import shardspeed
    from shardspeed.pipe import LayerSpec, PipelineModule

    out = {}
    out["stages_not_dividing"] = error_text(
        lambda: PipelineModule(layer_specs(), num_stages=3, loss_fn=loss_fn)
    )
    three = [LayerSpec(torch.nn.Linear, 4, 4) for _ in range(3)]
    out["too_many_stages"] = error_text(lambda: PipelineModule(three, num_stages=4))
    out["regex"] = error_text(
        lambda: PipelineModule(layer_specs(), num_stages=2, partition_method="type:conv")
    )
    model = PipelineModule(
        layer_specs(), num_stages=4, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED
    )
    out["zero2"] = error_text(
        lambda: shardspeed.initialize(model=model, config=dict(CONFIG, zero_optimization={"stage": 2}))
    )
    out["stages_key"] = error_text(
        lambda: shardspeed.initialize(model=model, config=dict(CONFIG, pipeline={"stages": 2}))
    )
    out["virtual_parts"] = error_text(
        lambda: shardspeed.initialize(model=model, config=dict(CONFIG, pipeline={"virtual_stages": 2}))
    )
    eight = PipelineModule(layer_specs(blocks=6), num_stages=4, loss_fn=loss_fn)
    out["virtual_gas"] = error_text(
        lambda: shardspeed.initialize(
            model=eight, config=dict(CONFIG, gradient_accumulation_steps=2, pipeline={"virtual_stages": 2})
        )
    )
    eight.set_virtual_stages(1)
    out["virtual_params"] = error_text(
        lambda: shardspeed.initialize(
            model=eight,
            model_parameters=list(model.parameters())[:2],
            config=dict(CONFIG, pipeline={"virtual_stages": 2}),
        )
    )
    one_stage = PipelineModule(layer_specs(), num_stages=1, loss_fn=loss_fn)
    out["virtual_one_stage"] = error_text(
        lambda: shardspeed.initialize(model=one_stage, config=dict(CONFIG, pipeline={"virtual_stages": 2}))
    )
    engine, *_ = shardspeed.initialize(
        model=model, config=dict(CONFIG, pipeline={"activation_checkpoint_interval": 1})
    )
    out["interval"] = model.activation_checkpoint_interval
    out["forward"] = error_text(lambda: engine(torch.zeros(2, 6, dtype=torch.long)))
    out["step"] = error_text(engine.step)
    out["no_data"] = error_text(engine.train_batch)
    inputs, labels = global_batches(1, 8)
    short = replica_iterator(inputs, labels, range(1), 0, 1, 2, 2)  # 2 micro-batches where 4 are needed
    out["dry"] = error_text(lambda: engine.train_batch(short))
    return out


def overflow() -> dict:
    import torch

    import shardspeed
    from shardspeed.pipe import PipelineModule

    specs = layer_specs(tripwire=True)  # the tripwire sits on stage 0 only
    model = PipelineModule(specs, num_stages=4, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
                           partition_method="uniform")  # fmt: skip
    config = dict(CONFIG, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = shardspeed.initialize(model=model, config=config)
    inputs, labels = global_batches(3, 8)
    data = replica_iterator(inputs, labels, range(3), 0, 1, 2, 4)
    snapshot = lambda: {n: p.detach().clone() for n, p in engine.module.named_parameters()}  # noqa: E731
    engine.train_batch(data)
    before, scale_before = snapshot(), engine.loss_scale()
    Tripwire.armed = True
    engine.train_batch(data)
    Tripwire.armed = False
    after_overflow = snapshot()
    record = {
        "stage": engine.stage_id,
        "holds_tripwire": any(isinstance(m, Tripwire) for _, m in model.local_layers()),
        "unchanged": all(torch.equal(before[n], after_overflow[n]) for n in before),
        "skipped": engine.skipped_steps,
        "scale": (scale_before, engine.loss_scale()),
        "applied": engine.was_step_applied(),
    }
    engine.train_batch(data)
    record["changed_after"] = any(
        not torch.equal(after_overflow[n], p) for n, p in engine.module.named_parameters()
    )
    return record


@pytest.fixture(scope="module")
def pipeline_results():
    return run_ranks(pipeline_job, 4)


def test_misuse_errors_name_the_problem(pipeline_results):
    for rank, (out, _) in enumerate(pipeline_results):  # every rank raises the same error
        assert "num_stages=3 does not divide the world size 4" in out["stages_not_dividing"]
        assert (
            out["too_many_stages"].startswith("PartitionError")
            and "4 stages but only 3 layers" in out["too_many_stages"]
        )
        assert "'conv' matches no layer class" in out["regex"]
        assert out["zero2"].startswith("ConfigError") and "zero_optimization.stage: 2" in out["zero2"]
        assert out["stages_key"] == (
            "ConfigError: pipeline.stages: 2, but the PipelineModule was built with 4 stages"
        )
        assert out["virtual_parts"] == (
            "PartitionError: PipelineModule: 4 stages x 2 virtual stages = 8 parts but only 6 layers; "
            "every part needs a layer"
        )
        assert out["virtual_gas"] == (
            "ConfigError: pipeline.virtual_stages: 2 (interleaved schedule) needs gradient_accumulation_steps (2) "
            "to be a multiple of the pipeline stages (4)"
        )
        assert out["virtual_params"].startswith(
            "ConfigError: pipeline.virtual_stages rebuilt the PipelineModule"
        )
        assert out["virtual_one_stage"] == (
            "ConfigError: pipeline.virtual_stages: 2 needs at least 2 pipeline stages (the module has 1)"
        )
        assert out["interval"] == 1  # the config's activation_checkpoint_interval overrides the module's 0
        assert out["forward"] == "PipelineError: Only train_batch() is accessible in pipeline mode."
        assert out["step"] == out["forward"]
        assert "no data" in out["no_data"]
        # Stages 0 and 3 read data; the middle stages learn what happened from them instead of hanging.
        assert "the data iterator ran dry after 2 of 4 micro-batches" in out["dry"], (rank, out["dry"])


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(pipeline_results):
    results = [overflow for _, overflow in pipeline_results]
    assert [r["holds_tripwire"] for r in results] == [True, False, False, False]
    for r in results:
        assert r["unchanged"], f"stage {r['stage']} stepped despite the overflow"
        assert r["skipped"] == 1 and not r["applied"]
        assert r["scale"] == (256.0, 128.0)
        assert r["changed_after"]


def test_partition_methods():
    assert uniform_bounds(6, 4) == [0, 2, 4, 5, 6]
    assert balanced_bounds([10, 1, 1, 1, 10], 3) == [0, 1, 4, 5]
    names = ["Embedding", "Block", "Block", "Block", "Block", "Embedding"]
    assert partition_layers("type:block", 2, names, None) == [0, 3, 6]
    assert partition_layers("parameters", 2, names, lambda: [128, 72, 72, 72, 72, 128]) == [0, 3, 6]
    with pytest.raises(PartitionError, match="'nope' is not one of"):
        partition_layers("nope", 2, names, None)


def test_schedules_are_instruction_lists():
    first, last = TrainSchedule(3, 2, 0).steps(), TrainSchedule(3, 2, 1).steps()
    assert first == [
        LoadMicroBatch(0), ForwardPass(0), SendActivation(0),
        LoadMicroBatch(1), ForwardPass(1), SendActivation(1), RecvGrad(0), BackwardPass(0),
        LoadMicroBatch(2), ForwardPass(2), SendActivation(2), RecvGrad(1), BackwardPass(1),
        RecvGrad(2), BackwardPass(2),
        ReduceTiedGrads(), ReduceGrads(), OptimizerStep(),
    ]  # fmt: skip
    assert last[:5] == [RecvActivation(0), LoadMicroBatch(0), ForwardPass(0), BackwardPass(0), SendGrad(0)]
    assert repr(first[0]) == "LoadMicroBatch(micro_batch=0)"
    # 1F1B bounds the micro-batches in flight on stage s by stages - s, whatever the micro-batch count.
    for stages in (2, 4):
        for stage in range(stages):
            steps = TrainSchedule(16, stages, stage).steps()
            live = peak = 0
            for inst in steps:
                live += isinstance(inst, ForwardPass) - isinstance(inst, BackwardPass)
                peak = max(peak, live)
            assert peak == stages - stage
            assert sum(isinstance(i, ForwardPass) for i in steps) == 16
    assert [type(i) for i in InferenceSchedule(1, 3, 1).steps()] == [
        RecvActivation,
        ForwardPass,
        SendActivation,
    ]
    with pytest.raises(ValueError, match="stage_id=2"):
        TrainSchedule(4, 2, 2)
