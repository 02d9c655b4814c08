"""`engine.load_module_state_dict`: DeepSpeed's way of loading a model-states dict's weights into the engine's
module (strict, non-strict, with keys allowed to be missing, a custom load function), and the pipeline engine's
refusal of a checkpoint that keeps its weights in layer files."""

import pytest
import torch

from harness import run_ranks


def _engine_cases():
    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(
        model=torch.nn.Linear(3, 2),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
    )
    source = torch.nn.Linear(3, 2)
    with torch.no_grad():
        source.weight.fill_(0.5)
        source.bias.fill_(-1.0)
    out = {}

    def weights():
        with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return engine.module.weight.detach().clone(), engine.module.bias.detach().clone()

    engine.load_module_state_dict({"module": source.state_dict()}, fetch_z3_params=True)
    out["strict"] = weights()
    # a strict load that may miss the weight: the bias is loaded, the weight kept
    engine.load_module_state_dict({"module": {"bias": torch.zeros(2)}}, allowed_missing_keys=["weight"],
                                  fetch_z3_params=True)  # fmt: skip
    out["allowed_missing"] = weights()
    for name, checkpoint, kwargs in [
        ("missing_outside", {"module": {"weight": torch.zeros(2, 3)}}, {"allowed_missing_keys": ["weight"]}),
        (
            "unexpected",
            {"module": {**source.state_dict(), "extra": torch.zeros(1)}},
            {"allowed_missing_keys": []},
        ),
    ]:
        try:
            engine.load_module_state_dict(checkpoint, fetch_z3_params=True, **kwargs)
            out[name] = "loaded"
        except RuntimeError as error:
            out[name] = str(error)
    engine.load_module_state_dict({"module": {"extra": torch.zeros(1)}}, strict=False,
                                  allowed_missing_keys=["weight"])  # fmt: skip
    out["non_strict"] = weights()  # unchanged: nothing of the module's was in it
    seen = {}
    engine.load_module_state_dict(
        {"module": {"a": 1}}, custom_load_fn=lambda src, dst: seen.update(src=src, dst=dst)
    )
    out["custom"] = (seen["src"], seen["dst"] is engine.module)
    return out


def test_engine_load_module_state_dict():
    (out,) = run_ranks(_engine_cases, 1)
    assert torch.equal(out["strict"][0], torch.full((2, 3), 0.5)) and torch.equal(
        out["strict"][1], -torch.ones(2)
    )
    assert torch.equal(out["allowed_missing"][0], torch.full((2, 3), 0.5))  # kept
    assert torch.equal(out["allowed_missing"][1], torch.zeros(2))
    assert "missing=['bias']" in out["missing_outside"], out["missing_outside"]
    assert "unexpected=['extra']" in out["unexpected"], out["unexpected"]
    # the refused loads above had loaded what matched before raising (as DeepSpeed's): the source's bias; the
    # non-strict load of nothing the module has changed nothing
    assert torch.equal(out["non_strict"][1], -torch.ones(2))
    assert out["custom"] == ({"a": 1}, True)


def test_pipeline_engine_refuses_layer_file_checkpoints():
    from shardspeed.runtime.pipeline_engine import PipelineEngine

    engine = object.__new__(PipelineEngine)  # the refusals come before anything of the engine is used
    with pytest.raises(NotImplementedError, match="layer files"):
        engine.load_module_state_dict({"module": None})
    with pytest.raises(ValueError, match="custom_load_fn"):
        engine.load_module_state_dict({"module": {}}, custom_load_fn=print)
