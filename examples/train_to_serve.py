"""Train a tiny Llama on the standard library's source bytes, then save it for `shardspeed-serve`.

    pip install -e ".[serve]"
    shardspeed --num_gpus 2 examples/train_to_serve.py --deepspeed_config examples/configs/tiny_llama_serve.json \
        --save_hf runs/tiny-llama
    shardspeed-serve runs/tiny-llama --port 28080 &
    curl -s localhost:28080/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "def ", "max_tokens": 64, "temperature": 0.5, "top_p": 0.9}'

What to expect: 1000 steps (a few minutes on two CPU cores) bring the loss to ~1.2 and the model writes
Python-looking text: ``__init__(self):\n        return self._set_self._context.replace(...``, names
and indentation right, meaning absent. Greedy decoding (temperature 0) of a model this small repeats
itself; a temperature around 0.5 with top_p reads better. 200 steps (loss ~2.5) give only fragments.

The same training loop as train_gpt.py (its corpus and windows), on a Hugging Face `LlamaForCausalLM` built
from a config (nothing downloaded), trained through the `deepspeed` API. Rank 0 then writes the model in
Hugging Face format (`save_pretrained`: config.json + safetensors) with a byte-level tokenizer built locally
(token id = byte value), which is what the server loads.
"""

from __future__ import annotations

import argparse

# shardspeed first: it quiets torch's import-time warning about NumPy, which a clean install does not have.
import shardspeed as deepspeed  # isort: skip
import torch
from tqdm import tqdm
from train_gpt import Windows, read_corpus
from transformers import LlamaConfig, LlamaForCausalLM

from shardspeed.mii.tokenizer import END_OF_TEXT, byte_tokenizer


def tiny_llama(dim: int, layers: int, seq: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=END_OF_TEXT + 1, hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 8 * 8,
        num_hidden_layers=layers, num_attention_heads=max(1, dim // 32), num_key_value_heads=max(1, dim // 64),
        max_position_embeddings=max(seq, 512), bos_token_id=None, eos_token_id=END_OF_TEXT,
        pad_token_id=END_OF_TEXT, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument(
        "--steps", type=int, default=1000, help="keep equal to the scheduler's total_num_steps"
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--corpus_bytes", type=int, default=4_000_000)
    parser.add_argument("--save_hf", required=True, help="directory for the Hugging Face model + tokenizer")
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    dataset = Windows(read_corpus(args.corpus_bytes), args.seq)
    model = tiny_llama(args.dim, args.layers, args.seq)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, training_data=dataset)
    rank = deepspeed.comm.get_rank()
    batches = iter(deepspeed.RepeatingLoader(loader))
    progress = tqdm(total=args.steps, disable=rank != 0, desc="training", unit="step")
    for _ in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(batches).to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss  # HF shifts the labels itself
            engine.backward(loss)
            engine.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")
        progress.update()
    progress.close()
    if rank == 0:
        engine.module.save_pretrained(args.save_hf)
        byte_tokenizer().save_pretrained(args.save_hf)
        print(f"saved to {args.save_hf}: serve it with `shardspeed-serve {args.save_hf}`")


if __name__ == "__main__":
    main()
