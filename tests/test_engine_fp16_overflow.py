"""fp16 overflow: the step is skipped on every rank, weights stay bit-for-bit, the schedule does not move."""

import torch

from common import base_config, micro_batch, params_of
from harness import run_ranks
from models import TinyGPT, token_batches


def _overflow_run(world: int) -> dict:
    import torch.distributed as dist

    import shardspeed

    torch.manual_seed(0)
    config = base_config(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, optimizer, _, scheduler = shardspeed.initialize(model=TinyGPT(), config=config)
    rank = dist.get_rank()
    data = token_batches(4, engine.train_batch_size())
    record = {}
    for step in range(4):
        before, lr_before, scale_before = params_of(engine.module), engine.get_lr(), optimizer.loss_scale
        for m in range(engine.gradient_accumulation_steps()):
            loss = engine(micro_batch(data, step, m, rank, world, 2))
            if step == 2 and m == 1 and rank == world - 1:
                loss = loss * float("inf")  # only one rank overflows; all must skip
            engine.backward(loss)
            engine.step()
        record[step] = {
            "applied": engine.was_step_applied(),
            "unchanged": all(torch.equal(before[k], v) for k, v in params_of(engine.module).items()),
            "lr_unchanged": engine.get_lr() == lr_before,
            "scale": (scale_before, optimizer.loss_scale),
        }
    record["skipped"] = engine.skipped_steps
    record["global_steps"] = engine.global_steps
    record["scheduler_iteration"] = scheduler.state_dict()["last_batch_iteration"]
    return record


def test_overflow_skips_step_on_all_ranks():
    for record in run_ranks(_overflow_run, 2, 2):
        assert record[2]["applied"] is False
        assert record[2]["unchanged"] is True
        assert record[2]["lr_unchanged"] is True
        assert record[2]["scale"] == (256.0, 128.0)  # hysteresis 1: halved at once
        for step in (0, 1, 3):
            assert record[step]["applied"] is True
            assert record[step]["unchanged"] is False
        assert record["skipped"] == 1
        assert record["global_steps"] == 4  # DeepSpeed counts skipped steps as global steps
        assert record["scheduler_iteration"] == 2  # stepped after steps 0, 1 and 3 only
