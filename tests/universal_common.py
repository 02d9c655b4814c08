"""The tiny model, data and config shared by the universal-checkpoint tests and by the script that has DeepSpeed
write a universal folder (tests/fixtures/make_ds_universal.py): plain torch only, so either library can import it.

The optimizer is torch's AdamW passed in by the script (DeepSpeed's own Adam needs a compiled kernel on CPU), so
both libraries step the same optimizer on the same data and their runs agree to rounding.
"""

from __future__ import annotations

import os

import torch

LR, STEPS, SAVE_AT, GLOBAL_BATCH = 0.01, 6, 3, 8


class TinyMLP(torch.nn.Module):
    """Two layers, a bias-free one and a LayerNorm: five parameters, one of them not a multiple of any world size."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.outer = torch.nn.Linear(10, 3, bias=False)

    def forward(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.outer(self.norm(torch.tanh(self.inner(x)))), y)


def build_model(seed: int = 0) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP()


def optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def config(world: int, stage: int) -> dict:
    """The same global batch at every world size (micro-batch 2), so a run may change world size mid-way."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GLOBAL_BATCH // (2 * world),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
    }  # fmt: skip


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """Every step's global batch: inputs [STEPS, GLOBAL_BATCH, 6], targets [STEPS, GLOBAL_BATCH, 3]."""
    g = torch.Generator().manual_seed(4321)
    return torch.randn(STEPS, GLOBAL_BATCH, 6, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 3, generator=g)


def train(engine, steps, rank: int, world: int) -> list[float]:
    """Optimizer steps `steps` of the run: micro-batch m of rank r takes samples [(m*world + r)*2, +2)."""
    xs, ys = data()
    gas, losses = engine.gradient_accumulation_steps(), []
    for step in steps:
        for m in range(gas):
            lo = (m * world + rank) * 2
            loss = engine((xs[step, lo : lo + 2], ys[step, lo : lo + 2]))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


# -- shardspeed's side (imported lazily: the DeepSpeed script imports this module too) -------------------


def shardspeed_engine(world: int, stage: int, seed: int, universal: bool = True):
    import shardspeed

    model = build_model(seed)
    cfg = config(world, stage)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = shardspeed.initialize(model=model, optimizer=optimizer(model), config=cfg)
    return engine


def full_params(engine) -> dict:
    from shardspeed.zero import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def save_and_convert(root: str) -> dict:
    """shardspeed's uninterrupted run at 2 ranks, ZeRO-2, saving at SAVE_AT; rank 0 then runs ds_to_universal.
    Returns the final parameters and those saved (the model-states file's `module`)."""
    import torch.distributed as dist

    from shardspeed.checkpoint.to_universal import main

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    engine = shardspeed_engine(world, 2, seed=0, universal=False)
    train(engine, range(SAVE_AT), rank, world)
    engine.save_checkpoint(root)
    train(engine, range(SAVE_AT, STEPS), rank, world)
    params = full_params(engine)
    engine.destroy()
    at_save = torch.load(f"{root}/global_step{SAVE_AT}/mp_rank_00_model_states.pt", weights_only=True)[
        "module"
    ]
    if rank == 0:
        tag = f"{root}/global_step{SAVE_AT}"
        main(["--input_folder", tag, "--output_folder", f"{tag}_universal", "--inject_missing_state",
              "--num_extract_workers", "2", "--num_merge_workers", "1"])  # fmt: skip
    dist.barrier()
    return {"final": params, "at_save": at_save}
