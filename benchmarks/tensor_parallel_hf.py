"""AutoTP on Hugging Face models: `shard_model` at tp 2 against the unsharded model, loss and gradients.

    PYTHONPATH=. /work/benchvenv/bin/python benchmarks/tensor_parallel_hf.py

Tiny random LLaMA, Qwen2 (q/k/v bias), Mistral, GPT-2 (fused `c_attn` in `Conv1D`), OPT and BERT models built from
their configs with transformers, in eval mode (dropout masks over sharded activations differ by design).
Two Gloo ranks; the tensor-parallel gradients are gathered whole and compared with the unsharded ones.
Writes benchmarks/results/tensor_parallel_hf.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job():
    import torch
    import torch.distributed as dist
    import transformers as tf

    from shardspeed.module_inject import shard_model
    from shardspeed.module_inject.tp_state import tp_full_state_dict

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    configs = {
        "LlamaForCausalLM": tf.LlamaConfig(**common, intermediate_size=48, num_key_value_heads=2),
        "Qwen2ForCausalLM": tf.Qwen2Config(**common, intermediate_size=48, num_key_value_heads=2),
        "MistralForCausalLM": tf.MistralConfig(**common, intermediate_size=48, num_key_value_heads=2),
        "GPT2LMHeadModel": tf.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=32),
        "OPTForCausalLM": tf.OPTConfig(
            **common, ffn_dim=48, word_embed_proj_dim=32, max_position_embeddings=32
        ),
        "BertForMaskedLM": tf.BertConfig(**common, intermediate_size=48, max_position_embeddings=32),
    }
    rows = []
    for name, config in configs.items():
        try:
            config._attn_implementation = "eager"
            torch.manual_seed(0)
            auto = tf.AutoModelForMaskedLM if name.startswith("Bert") else tf.AutoModelForCausalLM
            ref = auto.from_config(config).eval()
            torch.manual_seed(0)
            model = auto.from_config(config).eval()
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
            ref_loss = ref(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            report = shard_model(model, group)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            grads = tp_full_state_dict(model, group, {n: p.grad for n, p in model.named_parameters()})
            diff = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
            rows.append((name, abs(loss.item() - ref_loss.item()), diff, report.summary()))
        except Exception as err:  # recorded in the table
            rows.append((name, None, None, f"{type(err).__name__}: {err}"[:300]))
    return rows


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import transformers

    from harness import run_ranks

    rows = run_ranks(job, 2)[0]
    lines = [
        "# AutoTP on Hugging Face models (`benchmarks/tensor_parallel_hf.py`)",
        "",
        f"transformers {transformers.__version__}; tiny random models, tp 2 on two Gloo ranks, eval mode.",
        "",
        "| model | loss difference | max gradient difference (gathered) | placement |",
        "|---|---|---|---|",
    ]
    for name, loss, grad, summary in rows:
        shown = (f"{loss:.1e}", f"{grad:.1e}") if loss is not None else ("failed", "")
        lines.append(f"| {name} | {shown[0]} | {shown[1]} | {summary} |")
    out = ROOT / "benchmarks" / "results" / "tensor_parallel_hf.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
