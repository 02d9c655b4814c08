"""TRL's trainers as a TRL user runs them, with `deepspeed=<config>`: nothing in this script names shardspeed.

Run under torchrun with 2 processes. A tiny Llama is built from a config and saved (TRL builds its reference
model from the policy's path), a word-level tokenizer is built in memory, datasets are built in memory. For
each (trainer, ZeRO stage, offload) asked for it trains a few steps; rank 0 writes the logged losses (and
the GRPO rewards and KL), and what the reference model's engine was built with, to the JSON file given by
--out. Only `deepspeed` is imported, so the same file can run under DeepSpeed itself.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, set_seed

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "rug",
    "red",
    "blue",
    "big",
    "small",
    "and",
    "then",
    "it",
    "is",
    "was",
]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
SEED = 1234


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: index for index, word in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def save_tiny_llama(folder: str) -> str:
    """The same weights on every rank (same seed); each rank writes its own copy (no file race)."""
    set_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def sentences(count: int, offset: int = 0) -> list[str]:
    out = []
    for i in range(count):
        k = i + offset
        out.append(
            f"the {WORDS[2 + k % 2]} {WORDS[4 + k % 2]} on the {WORDS[8 + k % 2]} and {WORDS[12 + k % 2]}"
        )
    return out


OFFLOADS = ("", "offload", "offload_all")  # none; the optimizer state; the optimizer state and the parameters


def ds_config(stage: int, offload: str) -> dict:
    """A DeepSpeed config as HF's docs write it: "auto" wherever the Trainer knows the value."""
    if offload not in OFFLOADS or (offload == "offload_all" and stage != 3):
        raise ValueError(f"offload {offload!r}: one of {OFFLOADS[1:]}, offload_all at ZeRO-3 only")
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "offload_all":
        zero["offload_param"] = {"device": "cpu"}
    if stage == 3:
        zero.update(
            reduce_bucket_size="auto",
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
        )
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
    }


def common_args(out_dir: str, stage: int, offload: str, steps: int) -> dict:
    return dict(
        output_dir=out_dir, deepspeed=ds_config(stage, offload), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        seed=SEED, data_seed=SEED, disable_tqdm=True, use_cpu=not torch.cuda.is_available(), bf16=False,
        dataloader_num_workers=0,
    )  # fmt: skip


def sft(model_path: str, args: dict):
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": sentences(16)})
    config = SFTConfig(**args, max_length=16)
    return SFTTrainer(model=model_path, args=config, train_dataset=data, processing_class=tokenizer())


def dpo(model_path: str, args: dict):
    from trl import DPOConfig, DPOTrainer

    prompts = [f"the {WORDS[2 + i % 2]}" for i in range(16)]
    data = Dataset.from_dict(
        {
            "prompt": prompts,
            "chosen": [f"sat on the {WORDS[8 + i % 2]}" for i in range(16)],
            "rejected": [f"ran under {WORDS[14 + i % 2]} it" for i in range(16)],
        }
    )
    config = DPOConfig(**args, max_length=16, beta=0.1)
    return DPOTrainer(model=model_path, args=config, train_dataset=data, processing_class=tokenizer())


def reward_cats(completions, **kwargs) -> list[float]:
    """More "cat" and fewer "dog": a reward the policy can learn in a few steps."""
    return [float(text.split().count("cat") - text.split().count("dog")) for text in completions]


def grpo(model_path: str, args: dict):
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        **args, num_generations=2, max_completion_length=6, beta=0.1, temperature=1.0, shuffle_dataset=False
    )
    return GRPOTrainer(
        model=model_path,
        reward_funcs=reward_cats,
        args=config,
        train_dataset=_prompts(),
        processing_class=tokenizer(),
    )


def _prompts():
    """The prompts GRPO and RLOO generate from."""
    return Dataset.from_dict({"prompt": [f"the {WORDS[2 + i % 2]} {WORDS[4 + i % 2]}" for i in range(16)]})


def _reference_engine(ref) -> dict:
    """What TRL's prepare_deepspeed built for the reference model (an engine at ZeRO-3, else a module)."""
    import deepspeed
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    if not isinstance(ref, deepspeed.DeepSpeedEngine):
        return {"reference": type(ref).__name__}
    keys = (
        "stage",
        "reduce_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size",
    )
    zero = ref.config["zero_optimization"]  # the config as the engine read it (TRL's dotted keys nested)
    return {
        "reference": "engine",
        "reference zero": {key: zero.get(key) for key in keys},
        "reference optimizer is DeepSpeedZeRoOffload": isinstance(ref.optimizer, DeepSpeedZeRoOffload),
    }


def rloo(model_path: str, args: dict):
    from trl import RLOOConfig, RLOOTrainer

    config = RLOOConfig(**args, num_generations=2, max_completion_length=6, beta=0.1, shuffle_dataset=False)
    return RLOOTrainer(
        model=model_path,
        reward_funcs=reward_cats,
        args=config,
        train_dataset=_prompts(),
        processing_class=tokenizer(),
    )


def reward(model_path: str, args: dict):
    """A reward model: the saved causal LM loaded as a sequence classifier (its score head initialised from
    the seed), trained on preference pairs."""
    from trl import RewardConfig, RewardTrainer

    data = Dataset.from_dict(
        {
            "chosen": [f"the cat sat on the {WORDS[8 + i % 2]}" for i in range(16)],
            "rejected": [f"the dog ran under {WORDS[14 + i % 2]} it" for i in range(16)],
        }
    )
    config = RewardConfig(**args, max_length=16)
    return RewardTrainer(model=model_path, args=config, train_dataset=data, processing_class=tokenizer())


TRAINERS = {"sft": sft, "dpo": dpo, "grpo": grpo, "rloo": rloo, "reward": reward}
LOGGED = ("loss", "reward", "kl", "rewards/chosen", "rewards/margins")


def run(trainer_name: str, stage: int, offload: str, model_path: str, work: str, steps: int) -> dict:
    tag = f"{trainer_name}-z{stage}{'-' + offload if offload else ''}"
    set_seed(SEED)
    trainer = TRAINERS[trainer_name](model_path, common_args(os.path.join(work, tag), stage, offload, steps))
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {key: [entry.get(key) for entry in history] for key in LOGGED if any(key in e for e in history)}
    result.update(_reference_engine(getattr(trainer, "ref_model", None)))
    del trainer
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", nargs="+", default=["sft:2", "dpo:2", "grpo:2", "sft:3", "dpo:3", "grpo:3"],
                        help="trainer:stage, trainer:stage:offload or trainer:3:offload_all")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    model_path = save_tiny_llama(os.path.join(args.work, f"tiny-llama-rank{rank}"))
    results = {}
    for spec in args.runs:
        name, stage, *rest = spec.split(":")
        results[spec] = run(name, int(stage), rest[0] if rest else "", model_path, args.work, args.steps)
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
