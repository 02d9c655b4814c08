"""Lightning's DeepSpeedStrategy at ZeRO stage 2 on a small LightningModule, 2 ranks under torchrun.

Lightning's DeepSpeedStrategy is CUDA-only by two checks of its own (with DeepSpeed as with shardspeed):
`setup_environment` refuses any accelerator but CUDA, and `setup_distributed` requires device indices equal
to the local ranks (CPU devices have none). On a CPU-only machine this script uses a subclass that leaves
out exactly those two checks; on a GPU machine it uses the strategy as shipped. Trains 8 steps, saves a checkpoint at step 4 with
`trainer.save_checkpoint` (DeepSpeed's sharded layout), resumes a fresh Trainer from it with `ckpt_path`,
and writes rank 0's losses to the JSON file given by --out.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS, SAVE_AT = 8, 4


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy without its two CUDA-only checks (everything else unchanged)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips only the "CUDA GPUs only" check

    def setup_distributed(self) -> None:
        # Lightning's own body minus `_validate_device_index_selection` (CPU devices have no index)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SaveAfterFirstEpoch(pl.Callback):
    """Save a checkpoint at the end of the first epoch (step SAVE_AT; every rank writes its shard). At an
    epoch boundary, so the resumed run sees the same batches (Lightning restarts a half-done epoch)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, module) -> None:
        if trainer.current_epoch == 0:
            assert trainer.global_step == SAVE_AT, trainer.global_step
            trainer.save_checkpoint(self.path)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * 4 * SAVE_AT, 8, generator=generator)  # SAVE_AT steps per epoch on 2 ranks
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def trainer(callbacks=()) -> pl.Trainer:
    on_gpu = torch.cuda.is_available()
    strategy = (DeepSpeedStrategy if on_gpu else CPUDeepSpeedStrategy)(stage=2, logging_batch_size_per_gpu=4)
    return pl.Trainer(
        accelerator="gpu" if on_gpu else "cpu", devices=2, strategy=strategy, max_steps=STEPS, precision="32",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=list(callbacks), use_distributed_sampler=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ckpt = os.path.join(args.work, "step4.ckpt")

    pl.seed_everything(1234)
    model = Regression()
    trainer(callbacks=[SaveAfterFirstEpoch(ckpt)]).fit(model, data())
    pl.seed_everything(1234)
    resumed = Regression()
    trainer().fit(resumed, data(), ckpt_path=ckpt)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as handle:
            json.dump({"train": model.losses, "resumed": resumed.losses}, handle, indent=1)


if __name__ == "__main__":
    main()
