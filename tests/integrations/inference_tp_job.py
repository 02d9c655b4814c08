"""A DeepSpeed inference script: `deepspeed.init_inference` with tensor_parallel over every rank.

Nothing here names shardspeed (the `deepspeed` alias resolves to it). Run under torchrun with 2 processes.
For GPT-2, Llama, Mistral, Qwen2 and OPT (tiny random-weight configs, no downloads) each rank keeps an
unsharded copy as the reference, then checks the engine's logits (fp32, <= 1e-4), its greedy tokens against
the model's own `generate`, and that it holds about half of every block's linear weights. Then a model saved
with `save_pretrained` is rebuilt on the meta device and loaded tensor by tensor from its safetensors at
tp 2. Rank 0 writes the results to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
)

VOCAB = 96


def configs() -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    return {
        "gpt2": GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "llama": LlamaConfig(**common),
        "mistral": MistralConfig(**common, sliding_window=None),
        "qwen2": Qwen2Config(**common),
        "opt": OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    }


def block_linear_numel(model) -> int:
    """Elements of the 2-D weights inside the repeated blocks (Llama-style `layers.N`, GPT-2 `h.N`)."""
    total = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        in_block = ".layers." in f".{name}." or ".h." in f".{name}."
        if in_block and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            total += weight.numel()
    return total


def check_family(name, config, ids, mask) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    reference = copy.deepcopy(model)
    full_linear = block_linear_numel(reference)
    with torch.no_grad():
        ref_logits = reference(ids, attention_mask=mask).logits
        ref_tokens = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": dist.get_world_size()},
                                      dtype=torch.float32, max_out_tokens=64)  # fmt: skip
    logits = engine(ids, attention_mask=mask).logits
    tokens = engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    return {
        "logits_diff": float((logits - ref_logits).abs().max()),
        "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
        "linear_fraction": block_linear_numel(engine.module) / full_linear,
        "decoder": type(engine.decoder).__name__,
        "module_is_model": engine.module is model,
    }


def check_meta_load(name, config, ids, work) -> dict:
    """save_pretrained on rank 0; every rank builds on meta and loads its shard from the safetensors."""
    path = os.path.join(work, name)
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_config(config).eval()
    if dist.get_rank() == 0:
        reference.save_pretrained(path)
    dist.barrier()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    engine = deepspeed.init_inference(model, config={"tensor_parallel": {"tp_size": 2}, "dtype": "fp32"},
                                      checkpoint=path, max_out_tokens=64)  # fmt: skip
    with torch.no_grad():
        diff = (engine(ids).logits - reference(ids).logits).abs().max()
    tokens = engine.generate(ids, max_new_tokens=8, do_sample=False)
    ref_tokens = reference.generate(ids, max_new_tokens=8, do_sample=False)
    return {"logits_diff": float(diff), "tokens_equal": bool(torch.equal(tokens, ref_tokens))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    results = {name: check_family(name, config, ids, mask) for name, config in configs().items()}
    families = configs()
    results["meta_llama"] = check_meta_load("llama", families["llama"], ids, args.work)
    results["meta_gpt2"] = check_meta_load("gpt2", families["gpt2"], ids, args.work)
    if dist.get_rank() == 0:
        print(json.dumps(results, indent=1))
        with open(args.out, "w") as handle:
            json.dump(results, handle)
    dist.barrier()


if __name__ == "__main__":
    main()
