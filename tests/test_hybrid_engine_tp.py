"""Tensor-parallel generation in the hybrid engine (`hybrid_engine.inference_tp_size` 2) on 2 ranks, ZeRO-3.

- each rank's greedy rollouts equal those of `inference_tp_size` 1 and of the unsharded model (each rank
  brings different prompts: the group decodes them as one batch and each keeps its own rows);
- the weights the decode holds, in bytes, as the engine reports them: the layers' linears are halved per
  rank (this rank's shards), the rest (embedding, final norm, LM head) whole; while splitting, at most
  `tp_gather_partition_size` layers are whole at once;
- training after generate equals training without it (losses exactly equal), and the next generate
  decodes the updated weights;
- LoRA linears are split with their low-rank term folded in;
- what it cannot do is refused naming `hybrid_engine.inference_tp_size`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run_ranks
from inference_models import TinyLlama, greedy_reference, train_step

VOCAB = 64
PROMPTS = torch.tensor([[[5, 9, 3, 17], [8, 2, 30, 11]], [[40, 1, 7, 7], [12, 60, 33, 4]]])  # [rank, 2, 4]


def llama(lora: bool = False, kv_heads: int = 2) -> nn.Module:
    """The tiny Llama, its MLPs naming their activation (`act_fn`) as Hugging Face's Llama does."""
    if lora:
        from test_hybrid_engine_lora import lora_model

        model = lora_model()
    else:
        model = TinyLlama(vocab=VOCAB, kv_heads=kv_heads)
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.SiLU()  # what its forward applies (F.silu)
    return model


def _config(stage: int = 3, **hybrid) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32, **hybrid},
    }


def _engine(lora: bool = False, stage: int = 3, kv_heads: int = 2, **hybrid):
    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=llama(lora, kv_heads), config=_config(stage, **hybrid))
    return engine


def _reference(engine, prompts, new_tokens: int, lora: bool = False) -> torch.Tensor:
    """Greedy tokens of a plain copy of the engine's current weights, one full forward per token."""
    from shardspeed.zero.api import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    plain = llama(lora)
    plain.load_state_dict(state)
    rows = [greedy_reference(plain, row.tolist(), new_tokens) for row in prompts]
    return torch.cat([prompts, torch.tensor(rows)], dim=1)


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _expected_bytes() -> dict:
    model = llama()
    layers = list(model.model.layers)
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
    layer_ids = {id(p) for layer in layers for p in layer.parameters()}
    return {
        "model": _nbytes(model.parameters()),
        "layer linears": _nbytes(p for m in linears for p in m.parameters()),
        "one layer": _nbytes(layers[0].parameters()),
        "all layers": _nbytes(p for layer in layers for p in layer.parameters()),
        "outside layers": _nbytes(p for p in model.parameters() if id(p) not in layer_ids),
        "norms": _nbytes(p for layer in layers for n in ("input_layernorm", "post_attention_layernorm")
                         for p in getattr(layer, n).parameters()),
    }  # fmt: skip


def _refusal(**kwargs) -> str:
    try:
        _engine(**kwargs)
    except Exception as err:  # the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "accepted"


def _tp_cases() -> dict:
    import torch.distributed as dist

    out = {"expected bytes": _expected_bytes()}
    one = _engine()  # initialize starts the process group
    prompts = PROMPTS[dist.get_rank()]
    out["tp1"] = one.generate(prompts, max_new_tokens=10)
    out["tp1 bytes"] = dict(one.rollout.weight_bytes)
    two = _engine(inference_tp_size=2)
    two_small = _engine(inference_tp_size=2, tp_gather_partition_size=1)
    out["tp group size"] = dist.get_world_size(two.inference_tp_group)
    out["reference"] = _reference(two, prompts, 10)
    out["tp2"] = two.generate(prompts, max_new_tokens=10)
    out["tp2 bytes"] = dict(two.rollout.weight_bytes)
    out["tp2 peak"] = two.rollout.tensor_parallel.held["peak_split"]
    out["tp2 partition 1"] = two_small.generate(prompts, max_new_tokens=10)
    out["tp2 partition 1 peak"] = two_small.rollout.tensor_parallel.held["peak_split"]
    out["local numel after generate"] = sum(p.numel() for p in two.module.parameters())
    # the module's generate (DeepSpeed-Chat's call), with a mask and synced_gpus
    out["tp2 module.generate"] = two.module.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_length=8, synced_gpus=True
    )
    # training continues as without generate, and the next generate decodes the new weights
    losses = [train_step(two, VOCAB, 0), train_step(two, VOCAB, 1)]
    out["after steps"] = two.generate(prompts, max_new_tokens=10)
    out["after steps reference"] = _reference(two, prompts, 10)
    out["losses"] = losses + [train_step(two, VOCAB, 2)]
    plain = _engine()
    out["losses without generate"] = [train_step(plain, VOCAB, s) for s in range(3)]
    # LoRA: split with the low-rank term folded in
    lora = _engine(lora=True, inference_tp_size=2)
    out["lora"] = lora.generate(prompts, max_new_tokens=10)
    out["lora reference"] = _reference(lora, prompts, 10, lora=True)
    # prompts of different shapes cannot be one batch
    try:
        two.generate(prompts[:, : 3 + dist.get_rank()], max_new_tokens=2)
        out["ragged"] = "no error"
    except ValueError as err:
        out["ragged"] = str(err)
    out["refused at stage 2"] = _refusal(stage=2, inference_tp_size=2)
    out["refused unpinned"] = _refusal(inference_tp_size=2, pin_parameters=False)
    out["refused 3 of 2"] = _refusal(inference_tp_size=3)
    out["refused one kv head"] = _refusal(kv_heads=1, inference_tp_size=2)
    return out


@pytest.fixture(scope="module")
def tp_results() -> list[dict]:
    return run_ranks(_tp_cases, 2)


def test_tp2_generates_the_tokens_tp1_generates(tp_results):
    for rank, out in enumerate(tp_results):
        assert out["tp group size"] == 2
        assert torch.equal(out["tp1"], out["reference"]), rank
        assert torch.equal(out["tp2"], out["tp1"]), rank
        assert torch.equal(out["tp2 partition 1"], out["tp1"]), rank
        assert torch.equal(out["tp2 module.generate"], out["tp1"][:, :8]), rank
        assert torch.equal(out["lora"], out["lora reference"]), rank
        assert out["local numel after generate"] == 0  # partitioned again
    assert not torch.equal(tp_results[0]["tp2"], tp_results[1]["tp2"])  # each rank got its own rows back


def test_tp2_holds_half_of_the_layer_weights(tp_results):
    for out in tp_results:
        expected, one, two = out["expected bytes"], out["tp1 bytes"], out["tp2 bytes"]
        assert one == {"whole": expected["model"], "shards": 0, "copies": one["copies"]}
        # the layers' linear weights: all of them whole at tp 1, this rank's half at tp 2
        assert two["shards"] * 2 == expected["layer linears"]
        assert two["whole"] == expected["outside layers"]  # embedding, final norm, LM head
        assert two["copies"] == expected["norms"]  # the layers' norms, whole (no biases in o/down)
        assert sum(two.values()) < sum(one.values())
        # while splitting: every layer whole at once with tp_gather_partition_size 8, one with 1
        assert out["tp2 peak"] == expected["all layers"]
        assert out["tp2 partition 1 peak"] == expected["one layer"]


def test_training_after_tp_generate_is_unchanged(tp_results):
    for out in tp_results:
        assert out["losses"] == out["losses without generate"]  # exactly: generate wrote nothing
        assert torch.equal(out["after steps"], out["after steps reference"])
        assert not torch.equal(out["after steps"], out["tp2"])  # the new weights decode differently


def test_what_tp_generation_cannot_do_is_refused_by_name(tp_results):
    for out in tp_results:
        assert "inference_tp_size: the ranks of a tensor group" in out["ragged"]
        assert out["refused at stage 2"].startswith("ConfigError: hybrid_engine.inference_tp_size: 2")
        assert "zero_optimization.stage is 2" in out["refused at stage 2"]
        assert "pin_parameters" in out["refused unpinned"]
        assert "does not divide the 2 data-parallel ranks" in out["refused 3 of 2"]
        assert "k_proj has 1 heads, which do not divide over 2 ranks" in out["refused one kv head"]
