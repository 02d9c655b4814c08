"""Accelerate used directly with a DeepSpeed plugin: prepare, backward, step, save_state, load_state.

Run under torchrun with 2 processes. Nothing here names shardspeed: with the alias installed, Accelerate's
DeepSpeed path builds shardspeed's engine. For each ZeRO stage asked for it trains a tiny GPT-2 for 8 steps
(a torch AdamW and a torch LR schedule made by the user, as most Accelerate scripts do), saving the state
at step 4, then restores that state into freshly prepared objects and trains steps 5-8 again. Rank 0
writes the losses to the JSON file given by --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin, set_seed
from hf_trainer_job import SEQ, VOCAB, Tokens  # next to this script
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, GPT2Config

STEPS, SAVE_AT = 8, 4


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }


def prepared(stage: int):
    # The model is built whole before the Accelerator (its engine partitions it at ZeRO-3), so every stage
    # starts from the same weights; building under zero.Init is exercised by the Trainer job.
    set_seed(1234)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    if not torch.cuda.is_available():
        # On a CPU-only machine Accelerate starts Gloo only when asked for the CPU (TrainingArguments with
        # use_cpu=True does the same); the DeepSpeed plugin then takes over as on GPUs.
        PartialState(cpu=True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(stage)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    loader = DataLoader(Tokens(), batch_size=4, shuffle=False)
    return accelerator, *accelerator.prepare(model, optimizer, loader, schedule)


def train(accelerator, model, optimizer, loader, schedule, steps: range, save_dir: str | None) -> dict:
    losses = {}
    batches = iter(loader)
    for _ in range(steps.start):  # skip what was trained before the saved state
        next(batches)
    for step in steps:
        batch = next(batches)
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses[step + 1] = accelerator.reduce(loss.detach(), reduction="mean").item()
        if save_dir is not None and step + 1 == SAVE_AT:
            accelerator.save_state(save_dir)
    return losses


def run_stage(stage: int, work: str) -> dict:
    save_dir = os.path.join(work, f"accelerate-stage{stage}")
    accelerator, *objects = prepared(stage)
    result = {"train": train(accelerator, *objects, range(STEPS), save_dir)}
    state = accelerator.get_state_dict(objects[0])  # full weights on rank 0 (gathered under ZeRO-3)
    if accelerator.is_main_process:
        result["state_dict_numel"] = sum(v.numel() for v in state.values())
    accelerator.free_memory()
    AcceleratorState._reset_state(reset_partial_state=False)  # a second Accelerator with its own plugin

    accelerator, *objects = prepared(stage)
    accelerator.load_state(save_dir)
    result["resumed"] = train(accelerator, *objects, range(SAVE_AT, STEPS), None)
    accelerator.free_memory()
    AcceleratorState._reset_state(reset_partial_state=False)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {str(stage): run_stage(stage, args.work) for stage in args.stages}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
