"""The hybrid engine (`hybrid_engine.enabled`): `generate` from the engine being trained, on 2 ranks.

- `initialize` returns it (`isinstance` DeepSpeed's `DeepSpeedHybridEngine`, under both of its paths);
- its greedy `generate` (and the module's `generate`, which DeepSpeed-Chat calls) gives the unsharded model's
  tokens at ZeRO 0-3, before and after optimizer steps;
- under ZeRO-3 with `pin_parameters` each parameter unit is gathered once per `generate`, however many tokens
  are made, and released afterwards; with `pin_parameters` false, the model's own generate gathers per token;
- training after a `generate` equals training without it;
- `release_inference_cache`, `max_out_tokens`, and the keys it refuses (`inference_tp_size` > 1:
  test_hybrid_engine_tp.py; LoRA: test_hybrid_engine_lora.py).
The model is tests/inference_models.py's tiny Llama (torch only), which the fast decode path runs.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from inference_models import TinyLlama, greedy_reference, train_step

PROMPTS = torch.tensor([[5, 9, 3, 17], [8, 2, 30, 11]])
VOCAB = 64


class TinyLlamaWithGenerate(TinyLlama):
    """The tiny Llama with a `generate` of its own (greedy, the whole sequence each token), standing in for
    Hugging Face's: what the hybrid engine hands over to when parameters are not pinned."""

    def generate(self, input_ids, max_new_tokens=20, synced_gpus=False, **kwargs):
        del kwargs
        self.seen_synced_gpus = synced_gpus
        ids = input_ids
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self(ids).logits[:, -1:].argmax(-1)], dim=1)
        return ids


def _config(stage: int, **hybrid) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32, **hybrid},
    }


def _engine(stage: int, model_class=TinyLlama, **hybrid):
    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=model_class(vocab=VOCAB), config=_config(stage, **hybrid))
    return engine


def _unsharded_tokens(engine, new_tokens: int) -> torch.Tensor:
    """Greedy tokens of a plain copy of the engine's current weights, one full forward per token."""
    from shardspeed.zero.api import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        plain = TinyLlama(vocab=VOCAB)
        plain.load_state_dict({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    rows = [greedy_reference(plain, row.tolist(), new_tokens) for row in PROMPTS]
    return torch.cat([PROMPTS, torch.tensor(rows)], dim=1)


class _GatherCounter:
    """Counts the all-gathers that fill ZeRO-3 parameter units (param_units.py's one collective per unit)."""

    def __init__(self):
        import shardspeed.zero.param_units as units

        self.count, self._units, self._real = 0, units, units.all_gather_flat
        units.all_gather_flat = self._counting

    def _counting(self, *args, **kwargs):
        self.count += 1
        return self._real(*args, **kwargs)

    def during(self, fn):
        before = self.count
        result = fn()
        return result, self.count - before


def _generation_and_training(stage: int) -> dict:
    import shardspeed as deepspeed

    engine = _engine(stage)
    out = {
        "isinstance": isinstance(engine, deepspeed.DeepSpeedHybridEngine)
        and isinstance(engine, deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine),
        "plain engine class": type(deepspeed.initialize(model=TinyLlama(vocab=VOCAB),
                                                        config={**_config(stage), "hybrid_engine": {}})[0]).__name__,
    }  # fmt: skip
    counter = _GatherCounter()
    engine.eval()
    out["initial"] = engine.generate(PROMPTS, max_new_tokens=6)
    out["rollout is an inference tensor"] = out["initial"].is_inference()  # it could not be trained on
    out["initial reference"] = _unsharded_tokens(engine, 6)
    engine.train()
    losses = [train_step(engine, VOCAB, 0), train_step(engine, VOCAB, 1)]
    engine.eval()
    (long, out["gathers 12 tokens"]) = counter.during(lambda: engine.generate(PROMPTS, max_new_tokens=12))
    mask = torch.ones_like(PROMPTS)  # DeepSpeed-Chat's call: the module's generate, max_length, synced_gpus
    (short, out["gathers 2 tokens"]) = counter.during(
        lambda: engine.module.generate(PROMPTS, attention_mask=mask, max_length=6, synced_gpus=stage == 3)
    )
    out["after steps"], out["after steps, module.generate"] = long, short
    out["after steps reference"] = _unsharded_tokens(engine, 12)
    out["units"] = len(engine.optimizer.coordinator.units) if stage == 3 else 0
    out["local numel after generate"] = sum(p.numel() for p in engine.module.parameters())
    out["training mode in eval"] = engine.module.training
    engine.train()
    out["training mode in train"] = engine.module.training
    out["losses"] = losses + [train_step(engine, VOCAB, 2), train_step(engine, VOCAB, 3)]
    plain = _engine(stage)  # the same training, never generating
    out["losses without generate"] = [train_step(plain, VOCAB, s) for s in range(4)]
    engine.destroy()
    out["module generate restored"] = "generate" not in engine.module.__dict__
    return out


def _options() -> dict:
    out = {}
    # pin_parameters false: the model's own generate with the hooks on, gathering per token
    engine = _engine(3, TinyLlamaWithGenerate, pin_parameters=False)
    counter = _GatherCounter()
    engine.eval()
    _, out["unpinned gathers 2"] = counter.during(lambda: engine.generate(PROMPTS, max_new_tokens=2))
    tokens8, out["unpinned gathers 8"] = counter.during(lambda: engine.generate(PROMPTS, max_new_tokens=8))
    out["unpinned"], out["unpinned reference"] = tokens8, _unsharded_tokens(engine, 8)
    out["unpinned synced_gpus"] = engine.module.seen_synced_gpus  # set for the ranks' per-token gathers
    out["units"] = len(engine.optimizer.coordinator.units)
    # release_inference_cache: the KV cache is kept between calls (its buffers reused) or dropped
    kept = _engine(3)
    kept.generate(PROMPTS, max_new_tokens=3)
    first = kept.rollout.cache.keys[0].data_ptr()
    kept.generate(PROMPTS + 1, max_new_tokens=5)
    out["kept cache reused"] = kept.rollout.cache.keys[0].data_ptr() == first
    out["kept cache length"] = kept.rollout.cache.keys[0].shape[2]
    released = _engine(3, release_inference_cache=True)
    out["released"] = released.generate(PROMPTS, max_new_tokens=3)
    out["released reference"] = _unsharded_tokens(released, 3)
    out["released cache"] = released.rollout.cache
    try:
        released.generate(PROMPTS, max_new_tokens=29)  # 4 + 29 > 32
        out["too long"] = "no error"
    except ValueError as err:
        out["too long"] = str(err)
    return out


def _hybrid_cases() -> dict:
    # one process group for every case: starting ranks costs more than the cases
    return {
        "stages": {stage: _generation_and_training(stage) for stage in (0, 1, 2, 3)},
        "options": _options(),
    }


@pytest.fixture(scope="module")
def hybrid_results() -> list[dict]:
    return run_ranks(_hybrid_cases, 2)


def test_generate_matches_the_unsharded_model_and_training_is_unchanged(hybrid_results):
    for result in hybrid_results:
        out = result["stages"]
        for stage, case in out.items():
            assert case["isinstance"], stage
            assert case["plain engine class"] == "ShardspeedEngine"  # the block absent or disabled
            assert torch.equal(case["initial"], case["initial reference"]), stage
            assert torch.equal(case["after steps"], case["after steps reference"]), stage
            assert torch.equal(case["after steps, module.generate"], case["after steps reference"][:, :6]), (
                stage
            )
            assert not case["training mode in eval"] and case["training mode in train"]
            assert not case["rollout is an inference tensor"]
            assert case["losses"] == case["losses without generate"], stage  # exactly: same arithmetic
            assert case["module generate restored"]
        zero3 = out[3]
        # one gather per unit per generate call, however many tokens: not one per token
        assert zero3["units"] > 1
        assert zero3["gathers 12 tokens"] == zero3["gathers 2 tokens"] == zero3["units"]
        assert zero3["local numel after generate"] == 0  # partitioned again
        for stage in (0, 1, 2):
            assert out[stage]["gathers 12 tokens"] == 0


def test_pin_parameters_release_inference_cache_and_max_out_tokens(hybrid_results):
    for out in (result["options"] for result in hybrid_results):
        assert torch.equal(out["unpinned"], out["unpinned reference"])
        # per token: each unit once for every forward (8 forwards for 8 tokens, 2 for 2)
        assert out["unpinned gathers 8"] == 4 * out["unpinned gathers 2"] == 8 * out["units"]
        assert out["unpinned synced_gpus"] is True
        assert out["kept cache reused"] and out["kept cache length"] == 32
        assert torch.equal(out["released"], out["released reference"])
        assert out["released cache"] is None
        assert out["too long"].startswith("hybrid_engine.max_out_tokens: the prompt (4 tokens)")


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"tp_gather_partition_size": 4}, "hybrid_engine.tp_gather_partition_size: 4 has no effect with "),
        ({"enable_cuda_graph": True}, "hybrid_engine.enable_cuda_graph: true is not supported"),
        ({"max_out_token": 64}, "hybrid_engine.max_out_token"),  # a misspelt key, named
        ({"max_out_tokens": 0}, "hybrid_engine.max_out_tokens"),
    ],
)
def test_values_that_cannot_be_honoured_are_refused_by_name(block, message):
    from shardspeed.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 2, "hybrid_engine": {"enabled": True, **block}})


def test_tensor_parallel_generation_keys_are_accepted():
    from shardspeed.config import load_config

    block = {
        "enabled": True,
        "inference_tp_size": 2,
        "tp_gather_partition_size": 4,
    }  # tests/test_hybrid_engine_tp.py
    settings = load_config({"train_batch_size": 2, "hybrid_engine": block}).hybrid_engine
    assert settings.inference_tp_size == 2 and settings.tp_gather_partition_size == 4


def test_every_key_with_its_default_is_accepted():
    from shardspeed.config import load_config

    block = {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
             "pin_parameters": True, "tp_gather_partition_size": 8, "enable_cuda_graph": False}  # fmt: skip
    settings = load_config({"train_batch_size": 2, "hybrid_engine": block}).hybrid_engine
    assert settings.enabled and settings.max_out_tokens == 512 and settings.pin_parameters
