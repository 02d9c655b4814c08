"""LoRA fused around the hybrid engine's `generate` (DeepSpeed-Chat's actor with `--actor_lora_dim`).

The LoRA wrapping below is written here the way DeepSpeed-Chat's utilities lay it out (its
`convert_linear_layer_to_lora` / `LinearLayer_LoRA`): the frozen base `weight` and `bias` of the linear it
replaces, `lora_right_weight` [in, r], `lora_left_weight` [r, out], `lora_scaling` = scaling / r, and its own
in-place `fuse_lora_weight` / `unfuse_lora_weight`. The engine recognises it by those attributes, as
DeepSpeed's does.

- fused, the model's logits equal the unfused model's (1e-6, fp32) and the base weights are left the same bits;
- on 2 ranks at ZeRO 0 and 3: generate runs every LoRA linear fused (its unfused forward is never called),
  gives the greedy tokens of the unsharded, unfused model, leaves the base weights bitwise as they were,
  and training after it equals training without it; `engine.fuse_lora_weight()` / `unfuse_lora_weight()`
  at ZeRO-0, refused by name at ZeRO-3.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks
from inference_models import TinyLlama, greedy_reference, train_step

VOCAB = 64
PROMPTS = torch.tensor([[5, 9, 3, 17], [8, 2, 30, 11]])


class LoraLinear(nn.Module):
    """A linear with a low-rank term, in DeepSpeed-Chat's layout (see the module docstring)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, rank: int, scaling: float = 1.0):
        super().__init__()
        self.weight, self.bias = weight, bias
        out_features, in_features = weight.shape
        self.lora_right_weight = nn.Parameter(torch.empty(in_features, rank))
        self.lora_left_weight = nn.Parameter(torch.zeros(rank, out_features))
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        self.lora_scaling = scaling / rank
        self.weight.requires_grad = False  # only the low-rank factors train
        self.fuse_lora = False
        self.unfused_calls = 0  # how often the low-rank term was computed on the side

    def fuse_lora_weight(self):  # DeepSpeed-Chat's own, in place
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * (self.lora_left_weight.t() @ self.lora_right_weight.t())
        self.fuse_lora = True

    def unfuse_lora_weight(self):
        if self.fuse_lora:
            self.weight.data -= self.lora_scaling * (self.lora_left_weight.t() @ self.lora_right_weight.t())
        self.fuse_lora = False

    def forward(self, x):
        if self.fuse_lora:
            return F.linear(x, self.weight, self.bias)
        self.unfused_calls += 1
        low_rank = x @ self.lora_right_weight @ self.lora_left_weight
        return F.linear(x, self.weight, self.bias) + low_rank * self.lora_scaling


def convert_to_lora(model: nn.Module, part_name: str, rank: int) -> nn.Module:
    """Every `nn.Linear` whose name contains `part_name` becomes a `LoraLinear` over the same parameters."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and part_name in n]
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        setattr(parent, leaf, LoraLinear(linear.weight, linear.bias, rank))
    return model


def lora_model(left_seed: int | None = 1) -> nn.Module:
    """The tiny Llama with LoRA on every linear of its layers; `left_seed` gives the (normally zero) left
    factors random values, so the low-rank term matters from the first token."""
    model = convert_to_lora(TinyLlama(vocab=VOCAB), "layers.", rank=4)
    if left_seed is not None:
        g = torch.Generator().manual_seed(left_seed)
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.lora_left_weight.data = torch.randn(module.lora_left_weight.shape, generator=g) * 0.2
    return model


def _base_weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora" not in n}


def test_fused_logits_equal_the_unfused_and_the_base_weights_are_untouched():
    from shardspeed.inference.lora import fused_lora, lora_linears

    model = lora_model()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    before = _base_weights(model)
    with torch.no_grad():
        unfused = model(ids).logits
        layers = lora_linears(model)
        calls = sum(m.unfused_calls for m in layers)
        with fused_lora(model) as copies:
            fused = model(ids).logits
        assert sum(m.unfused_calls for m in layers) == calls  # the fused forward ran, not the module's own
        # DeepSpeed-Chat's own in-place fusion gives the same numbers
        for m in layers:
            m.fuse_lora_weight()
        in_place = model(ids).logits
        for m in layers:
            m.unfuse_lora_weight()
    assert len(copies) == len(layers) == 14  # q, k, v, o, gate, up, down in each of 2 layers
    assert (unfused - fused).abs().max() <= 1e-6
    assert (fused - in_place).abs().max() <= 1e-6
    with torch.no_grad():
        base_only = lora_model(left_seed=None)(ids).logits  # zero left factors: no low-rank term
    assert (unfused - base_only).abs().max() > 1e-2  # the low-rank term changes the logits
    assert all("forward" not in m.__dict__ for m in layers)  # the modules' own forward again
    fresh = lora_model()
    for name, weight in _base_weights(fresh).items():
        assert torch.equal(before[name], weight), name  # ours never wrote them


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32},
    }


def _full_state(engine) -> dict:
    from shardspeed.zero.api import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _lora_case(stage: int) -> dict:
    import shardspeed

    engine, *_ = shardspeed.initialize(model=lora_model(), config=_config(stage))
    layers = [m for m in engine.module.modules() if isinstance(m, LoraLinear)]
    losses = [train_step(engine, VOCAB, 0)]
    state = _full_state(engine)
    out = {"engine fuse": _engine_fuse(engine, layers, stage)}
    engine.eval()
    calls = sum(m.unfused_calls for m in layers)
    tokens = engine.generate(PROMPTS, max_new_tokens=8)
    out.update({"unfused calls in generate": sum(m.unfused_calls for m in layers) - calls,
                "fused count": engine.rollout.last_lora_fused, "tokens": tokens,
                "copies bytes": engine.rollout.weight_bytes["copies"]})  # fmt: skip
    after = _full_state(engine)
    out["base unchanged"] = all(torch.equal(state[k], after[k]) for k in state)
    plain = lora_model(left_seed=None)
    plain.load_state_dict(state)
    rows = [greedy_reference(plain, row.tolist(), 8) for row in PROMPTS]
    out["reference"] = torch.cat([PROMPTS, torch.tensor(rows)], dim=1)
    engine.train()
    out["losses"] = losses + [train_step(engine, VOCAB, 1), train_step(engine, VOCAB, 2)]
    without, *_ = shardspeed.initialize(model=lora_model(), config=_config(stage))
    out["losses without generate"] = [train_step(without, VOCAB, s) for s in range(3)]
    out["forwards restored"] = all("forward" not in m.__dict__ for m in layers)
    return out


def _engine_fuse(engine, layers, stage: int):
    """DeepSpeed's `engine.fuse_lora_weight()` / `unfuse_lora_weight()`: the fused logits' distance from the
    unfused ones and whether the LoRA linears ran fused (ZeRO 0-2); under ZeRO-3, the refusal."""
    if stage == 3:
        try:
            engine.fuse_lora_weight()
        except NotImplementedError as err:
            return str(err)
        return "no error"
    with torch.no_grad():
        unfused = engine.module(PROMPTS).logits
        engine.fuse_lora_weight()
        calls = sum(m.unfused_calls for m in layers)
        fused = engine.module(PROMPTS).logits
        ran_fused = sum(m.unfused_calls for m in layers) == calls
        engine.unfuse_lora_weight()
    return {"diff": (fused - unfused).abs().max().item(), "ran fused": ran_fused,
            "restored": all("forward" not in m.__dict__ for m in layers)}  # fmt: skip


def _lora_cases() -> dict:
    return {stage: _lora_case(stage) for stage in (0, 3)}


def test_generate_runs_lora_fused_and_training_continues():
    for result in run_ranks(_lora_cases, 2):
        for stage, out in result.items():
            assert out["fused count"] == 14, stage
            assert out["unfused calls in generate"] == 0, stage  # every LoRA linear ran fused
            assert torch.equal(out["tokens"], out["reference"]), stage
            assert out["base unchanged"], stage
            assert out["losses"] == out["losses without generate"], stage  # exactly
            assert out["forwards restored"], stage
            # the fused weights are the call's only copies (LoRA linears are not fused into q/k/v, gate/up)
            base = lora_model()
            expected = sum(m.weight.numel() * 4 for m in base.modules() if isinstance(m, LoraLinear))
            assert out["copies bytes"] == expected, stage
        zero0, zero3 = result[0]["engine fuse"], result[3]["engine fuse"]
        assert zero0["diff"] <= 1e-6 and zero0["ran fused"] and zero0["restored"]
        assert zero3.startswith("fuse_lora_weight: under ZeRO-3")
