"""A plain Hugging Face Trainer script with `deepspeed=<config>`: nothing in it names shardspeed.

Run under torchrun with 2 processes. For each ZeRO stage asked for it trains a tiny GPT-2 (built from a
config: no downloads) for 8 steps saving a checkpoint at step 4, then resumes a fresh Trainer from that
checkpoint to step 8, then (stage 3) saves the model with `save_model` and reloads it with `from_pretrained`.
Rank 0 writes the per-step losses and checks to the JSON file given by --out. The same file runs under
DeepSpeed itself (benchmarks/hf_trainer_vs_deepspeed.py compares the two).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments, set_seed

VOCAB, SEQ, SAMPLES = 64, 16, 64


class Tokens(Dataset):
    """Deterministic token sequences with a learnable pattern (next token = previous + 1 mod VOCAB)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        start = (index * 7) % VOCAB
        ids = (torch.arange(SEQ) + start) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def gpt2_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def ds_config(stage: int, bf16: bool, torch_adam: bool = False) -> dict:
    """A DeepSpeed config as HF's docs write it: "auto" wherever the Trainer knows the value."""
    zero = {"stage": stage}
    if stage == 3:
        zero.update(
            stage3_gather_16bit_weights_on_model_save=True,
            reduce_bucket_size="auto",
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
        )
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                                  **({"torch_adam": True} if torch_adam else {})}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": zero,
    }  # fmt: skip


TORCH_ADAM = False  # --torch-adam: torch's AdamW under DeepSpeed too (no fused kernel to JIT-build on a CPU)


def arguments(out_dir: str, stage: int, bf16: bool, max_steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out_dir, deepspeed=ds_config(stage, bf16, TORCH_ADAM), bf16=bf16, max_steps=max_steps,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=5e-3, warmup_steps=2,
        weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_steps=4, save_strategy="steps",
        report_to=[], seed=1234, data_seed=1234, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )  # fmt: skip


def losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def new_trainer(out_dir: str, stage: int, bf16: bool, args_first: bool) -> Trainer:
    """`args_first`: TrainingArguments before the model, so that under a ZeRO-3 config `from_config` builds
    it already partitioned (inside deepspeed.zero.Init), as HF's docs describe. Otherwise the model is built
    whole (and the engine partitions it), which initialises it exactly as at stages 0-2."""
    args = arguments(out_dir, stage, bf16, 8) if args_first else None
    set_seed(1234)
    model = AutoModelForCausalLM.from_config(gpt2_config())
    args = args or arguments(out_dir, stage, bf16, 8)
    return Trainer(model=model, args=args, train_dataset=Tokens())


def resume_other(stage: int, work: str, bf16: bool, source: str) -> dict:
    """Resume from the checkpoint-4 another run (another library) wrote under `source`, to step 8."""
    resumed = new_trainer(os.path.join(work, f"stage{stage}"), stage, bf16, args_first=True)
    resumed.train(resume_from_checkpoint=os.path.join(source, f"stage{stage}", "checkpoint-4"))
    return {"resumed": losses(resumed)}


def run_stage(stage: int, work: str, bf16: bool) -> dict:
    out_dir = os.path.join(work, f"stage{stage}")
    trainer = new_trainer(out_dir, stage, bf16, args_first=False)
    trainer.train()
    result = {"train": losses(trainer)}
    result["grad_norm"] = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    del trainer

    resumed = new_trainer(out_dir, stage, bf16, args_first=True)
    result["params_at_start"] = sum(p.numel() for p in resumed.model.parameters())  # 0: partitioned
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-4"))
    result["resumed"] = losses(resumed)

    if stage == 3:  # full weights out of a ZeRO-3 run, reloaded without DeepSpeed
        probe = (torch.arange(SEQ // 2).unsqueeze(0) * 3) % VOCAB
        model = resumed.model  # the module inside the engine: its forward gathers ZeRO-3 parameters
        model.eval()
        with torch.no_grad():
            result["trained_logits"] = model(probe).logits[0, -1, :8].tolist()
            result["trained_generation"] = model.generate(probe, max_new_tokens=4, do_sample=False,
                                                          synced_gpus=True).tolist()  # fmt: skip
        export = os.path.join(out_dir, "export")
        resumed.save_model(export)
        resumed.accelerator.wait_for_everyone()
        import deepspeed

        # from_pretrained while the ZeRO-3 config is active: built partitioned, weights loaded into the shards
        partitioned = AutoModelForCausalLM.from_pretrained(export)
        result["from_pretrained_local_numel"] = sum(p.numel() for p in partitioned.parameters())
        with deepspeed.zero.GatheredParameters(list(partitioned.parameters())), torch.no_grad():
            result["partitioned_logits"] = partitioned.eval()(probe).logits[0, -1, :8].tolist()
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # load as a downstream user without DeepSpeed would
        reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
        with torch.no_grad():
            result["reloaded_logits"] = reloaded(probe).logits[0, -1, :8].tolist()
            result["reloaded_generation"] = reloaded.generate(
                probe, max_new_tokens=4, do_sample=False
            ).tolist()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--torch-adam", action="store_true", help="optimizer.params.torch_adam: true")
    parser.add_argument(
        "--resume-from", help="only resume, from the checkpoints another run wrote in this --work"
    )
    args = parser.parse_args()
    global TORCH_ADAM
    TORCH_ADAM = args.torch_adam
    if args.resume_from:
        results = {str(s): resume_other(s, args.work, args.bf16, args.resume_from) for s in args.stages}
    else:
        results = {str(stage): run_stage(stage, args.work, args.bf16) for stage in args.stages}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
