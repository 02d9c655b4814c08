"""ALST through Accelerate and the Hugging Face Trainer: nothing here names shardspeed.

Trains a tiny Llama or Qwen2 (built from a config, attn_implementation="sdpa") with `deepspeed=<config>` for
a few steps of one sample each. `--sp 2` (2 processes) passes Accelerate's
`ParallelismConfig(sp_backend="deepspeed", sp_size=2)` to the Trainer, which then registers
`UlyssesSPAttentionHF`, wraps its data loader in `UlyssesSPDataLoaderAdapter` and computes the loss over the
sequence group; `--sp 1` (1 process) is the plain Trainer on whole sequences, the reference. Both see the
same sample at each step (the adapter hands rank 1's draw to the group after rank 0's, which is the order of
one process's sampler). Rank 0 writes {model: {"loss": {step: loss}, ...}} to --out, with the sequence
lengths its model saw and the attention function it ran.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Trainer,
    TrainingArguments,
    set_seed,
)

VOCAB, SEQ, SAMPLES, STEPS = 96, 32, 32, 6


class Tokens(Dataset):
    """Sequences with a learnable pattern (next token = previous + stride), and their position ids."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        start, stride = (index * 7) % VOCAB, 1 + index % 3
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ)}


def model_config(name: str):
    # 4 query heads over 2 key/value heads (GQA), both divisible by the sequence degree 2
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)  # fmt: skip
    if name == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common, use_sliding_window=False)


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": stage},
    }  # fmt: skip


def parallelism(sp: int):
    if sp == 1:
        return None
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler)


def train(name: str, sp: int, stage: int, work: str) -> dict:
    args = TrainingArguments(
        output_dir=os.path.join(work, f"{name}-sp{sp}"), deepspeed=ds_config(stage), max_steps=STEPS,
        per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=3e-3, warmup_steps=2,
        weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=1234,
        data_seed=1234, disable_tqdm=True, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        parallelism_config=parallelism(sp),
    )  # fmt: skip
    set_seed(1234)
    model = AutoModelForCausalLM.from_config(model_config(name), attn_implementation="sdpa")
    lengths = set()  # the sequence lengths this rank's model saw: SEQ / sp when the adapter shards
    model.get_input_embeddings().register_forward_pre_hook(lambda m, inputs: lengths.add(inputs[0].shape[1]))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {
        "loss": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "lengths": sorted(lengths),
        "attention": ALL_ATTENTION_FUNCTIONS["sdpa"].__qualname__,  # Ulysses' wrapper when sp > 1
        "engine": type(trainer.model_wrapped).__name__,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", type=int, required=True)
    parser.add_argument("--models", nargs="+", default=["llama"])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # one sequence-parallel model per process: registering Ulysses is process-wide (Transformers' registry)
    if args.sp > 1 and len(args.models) > 1:
        raise SystemExit("--sp > 1 trains one model per process")
    results = {name: train(name, args.sp, args.stage, args.work) for name in args.models}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
