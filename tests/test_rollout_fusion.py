"""The hybrid engine's decode path fuses q/k/v and gate/up into copies held only for one `generate` call.

One process, no engine (RolloutGenerator with nothing to gather), tests/inference_models.py's tiny Llama:
- the tokens are the unfused decoder's and the full-forward reference's;
- the model's parameters keep their identity and storage (an optimizer and ZeRO hold them by identity);
- the decoder of the call decodes from fused copies, and nothing of them outlives the call;
- a weight changed between calls (an optimizer step) is what the next call decodes with.
"""

from __future__ import annotations

import gc
import weakref

import torch

from shardspeed.inference import decoder as decoder_module
from shardspeed.inference.fusion import FusedLinear
from shardspeed.inference.generation import GenerationSettings, generate_tokens
from shardspeed.inference.rollout import RolloutGenerator

from inference_models import TinyLlama, greedy_reference

PROMPTS = torch.tensor([[5, 9, 3, 17], [8, 2, 30, 11]])
NEW = 6


def _model() -> TinyLlama:
    """The tiny Llama, its MLPs naming their activation (as Hugging Face's do), so gate/up fuse too."""
    torch.manual_seed(0)
    model = TinyLlama(vocab=64).eval()
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.SiLU()  # what the MLP's forward applies (F.silu)
    return model


def _rollout(model) -> RolloutGenerator:
    return RolloutGenerator(model, max_out_tokens=16, release_cache=False, model_generate=None)


def _unfused_tokens(model) -> torch.Tensor:
    settings = GenerationSettings.resolve(
        model, PROMPTS.shape[1], {"max_new_tokens": NEW, "do_sample": False}
    )
    decoder = decoder_module.FastDecoder(model, fuse=False)
    assert all(f is None for f in decoder.qkv + decoder.gate_up)
    return generate_tokens(decoder, PROMPTS, None, settings, 16)


def _reference(model) -> list[list[int]]:
    with torch.no_grad():
        return [greedy_reference(model, row.tolist(), NEW) for row in PROMPTS]


def test_fused_copies_give_the_same_tokens_and_leave_the_parameters_alone(monkeypatch):
    model = _model()
    before = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    built = []
    real = decoder_module.FastDecoder

    class Spy(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            fused = self.qkv + self.gate_up
            built.append(
                {
                    "all fused copies": all(isinstance(f, FusedLinear) and f.copy for f in fused),
                    "decoder": weakref.ref(self),
                    "weights": [weakref.ref(f.weight) for f in fused],
                }
            )

    monkeypatch.setattr("shardspeed.inference.rollout.FastDecoder", Spy)
    rollout = _rollout(model)
    out = rollout.generate(PROMPTS, max_new_tokens=NEW, do_sample=False)
    assert out[:, PROMPTS.shape[1] :].tolist() == _reference(model)
    assert torch.equal(out, _unfused_tokens(model))

    (call,) = built
    assert call["all fused copies"] and len(call["weights"]) == 2 * len(model.model.layers)
    gc.collect()
    assert call["decoder"]() is None and all(ref() is None for ref in call["weights"])  # died with the call
    after = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    assert all(after[name][0] is param and after[name][1] == ptr for name, (param, ptr) in before.items())


def test_the_next_call_decodes_with_the_weights_as_they_are_then():
    model = _model()
    rollout = _rollout(model)
    first = rollout.generate(PROMPTS, max_new_tokens=NEW, do_sample=False)
    with torch.no_grad():  # an optimizer step on every fused weight
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.mlp.gate_proj, layer.mlp.up_proj):  # fmt: skip
                linear.weight.add_(torch.randn_like(linear.weight) * 0.5)
    second = rollout.generate(PROMPTS, max_new_tokens=NEW, do_sample=False)
    assert second[:, PROMPTS.shape[1] :].tolist() == _reference(model)
    assert not torch.equal(first, second)  # the change is visible in the tokens, so the check above can fail
