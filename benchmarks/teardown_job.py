"""A short ZeRO training job that ends the way real scripts do: collectives right up to the exit.

Run by benchmarks/soak_teardown.py through the `shardspeed` launcher; the job succeeds when every rank
exits 0. Environment: SOAK_STAGE (ZeRO stage, default 2), SOAK_STEPS (default 5).
"""

import os

import shardspeed as deepspeed  # isort: skip (quiets torch's NumPy warning first)
import torch
import torch.distributed as dist


def main() -> None:
    stage = int(os.environ.get("SOAK_STAGE", "2"))
    steps = int(os.environ.get("SOAK_STEPS", "5"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(steps):
        loss = engine(torch.randn(4, 16, generator=data)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # a user's last collective, as in most training scripts
    if engine.global_rank == 0:
        print(
            f"teardown job done: stage {stage}, {steps} steps, mean loss {mean.item() / dist.get_world_size():.5f}"
        )


if __name__ == "__main__":
    main()
