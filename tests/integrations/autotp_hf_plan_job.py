"""A DeepSpeed AutoTP training script: a Hugging Face model sharded by its own tp_plan (`tensor_parallel.autotp_size`).

Nothing here names shardspeed (the `deepspeed` alias resolves to it). Run under torchrun with 2 processes.
For an untied Qwen2 and a tied Llama (tiny random-weight configs, no downloads, fp32, sdpa): each rank trains an
unsharded copy as the reference, then the engine at tp 2 (ZeRO 1) on the same batches; rank 0 writes the
largest loss difference, the head's layout (the plan's `colwise_gather_output` head is column-parallel with
its logits gathered; a tied head stays whole) and the fraction of q_proj weights this rank holds to --out.
"""

from __future__ import annotations

import argparse
import copy
import json

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

STEPS, VOCAB = 3, 128


def build(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    if family == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False)
    else:
        config = LlamaConfig(**common, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def run(family: str) -> dict:
    batches = torch.randint(0, VOCAB, (STEPS, 2, 12), generator=torch.Generator().manual_seed(3))
    model = build(family)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    ref_losses = []
    for ids in batches:
        optimizer.zero_grad()
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        ref_losses.append(loss.item())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "tensor_parallel": {"autotp_size": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config)
    losses = []
    for ids in batches:
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    q_proj = model.model.layers[0].self_attn.q_proj
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "logits_width": out.logits.shape[-1],
        "head": type(model.lm_head).__name__,
        "head_gathered": bool(getattr(model.lm_head, "gather_output", False)),
        "head_tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "q_fraction": q_proj.weight.numel() / reference.model.layers[0].self_attn.q_proj.weight.numel(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work")
    parser.add_argument("--out")
    args = parser.parse_args()
    deepspeed.init_distributed()
    results = {family: run(family) for family in ("qwen2", "llama")}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
