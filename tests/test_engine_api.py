"""The DeepSpeed-facing API: initialize's arguments and return value, the engine's methods and counters."""

import argparse
import json
import os

import torch

from common import base_config, micro_batch, params_of
from harness import run_ranks
from models import TinyGPT, token_batches


def _api_cases(config_path: str) -> dict:
    import torch.distributed as dist

    import shardspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # the launcher's env contract
    out = {}

    # Config from args.deepspeed_config (as the launcher-driven scripts pass it); 4-tuple returned.
    parser = shardspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    torch.manual_seed(rank)  # different init per rank: the engine must broadcast rank 0's weights
    result = shardspeed.initialize(args=args, model=TinyGPT())
    engine, optimizer, loader, scheduler = result
    out["tuple_len"] = len(result)
    out["optimizer_is_engine_optimizer"] = optimizer is engine.optimizer
    out["loader_is_none"] = loader is None
    out["scheduler_type"] = type(scheduler).__name__
    out["weights"] = params_of(engine.module)
    out["batch"] = (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )

    # Boundaries, counters, was_step_applied, no_sync.
    data = token_batches(3, engine.train_batch_size())
    flags = []
    for m in range(2):
        flags.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(micro_batch(data, 0, m, rank, world, 2)))
        engine.step()
        flags.append(engine.was_step_applied())
    out["boundary_flags"] = flags
    out["counters"] = (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps)
    out["grad_norm_positive"] = engine.get_global_grad_norm() > 0
    with engine.no_sync():
        engine.backward(engine(micro_batch(data, 1, 0, rank, world, 2)))
        local = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        try:
            engine.step()
        except RuntimeError as err:
            out["step_in_no_sync"] = (str(err), isinstance(err, AssertionError))  # DeepSpeed asserts
        try:
            with engine.no_sync():
                pass
        except AssertionError as err:
            out["nested_no_sync"] = str(err)
    gathered = [torch.empty_like(local["tok.weight"]) for _ in range(world)]
    dist.all_gather(gathered, local["tok.weight"])
    out["no_sync_grads_differ"] = not torch.equal(gathered[0], gathered[-1])
    engine.zero_grad()

    engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * world * 4)
    out["gas_after_set"] = engine.gradient_accumulation_steps()
    try:
        engine.set_train_batch_size(3)
    except ValueError as err:
        out["bad_batch"] = str(err)

    # A client optimizer instance and a client scheduler callable override the config blocks.
    model = TinyGPT()
    client_opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine2, opt2, _, sched2 = shardspeed.initialize(
        model=model, optimizer=client_opt, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
        config=base_config(),
    )  # fmt: skip
    out["client_optimizer"] = type(opt2.optimizer).__name__
    out["client_scheduler"] = type(sched2).__name__
    engine2.backward(engine2(micro_batch(data, 0, 0, rank, world, 2)))
    engine2.step()
    engine2.backward(engine2(micro_batch(data, 0, 1, rank, world, 2)))
    engine2.step()
    out["client_lr_after_step"] = engine2.get_lr()

    # training_data: each rank gets a disjoint shard, reshuffled every epoch.
    dataset = torch.arange(16).unsqueeze(1)
    _, _, loader3, _ = shardspeed.initialize(model=TinyGPT(), training_data=dataset, config=base_config())
    epochs = [torch.cat(list(loader3)).flatten().tolist() for _ in range(2)]
    out["epochs"] = epochs
    out["repeating"] = [b.flatten().tolist() for _, b in zip(range(6), shardspeed.RepeatingLoader(loader3))]
    return out


def test_initialize_and_engine_api(tmp_path):
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(base_config()))
    results = run_ranks(_api_cases, 2, str(config_path))
    r0, r1 = results
    assert r0["tuple_len"] == 4 and r0["optimizer_is_engine_optimizer"] and r0["loader_is_none"]
    assert r0["scheduler_type"] == "WarmupLR"
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])  # broadcast
    assert r0["batch"] == (8, 2, 2)
    assert r0["boundary_flags"] == [False, False, True, True]
    assert r0["counters"] == (1, 2, 8, 0)
    assert r0["grad_norm_positive"]
    assert (
        "illegal to call Engine.step() inside no_sync" in r0["step_in_no_sync"][0]
        and r0["step_in_no_sync"][1]
    )
    assert "reentry is unsupported" in r0["nested_no_sync"]
    assert r0["no_sync_grads_differ"]  # gradients were not averaged inside no_sync
    assert r0["gas_after_set"] == 4
    assert "not divisible" in r0["bad_batch"]
    assert r0["client_optimizer"] == "SGD" and r0["client_scheduler"] == "StepLR"
    assert r0["client_lr_after_step"] == [0.25]
    for r in results:  # 4 micro-batches per epoch per rank: the repeating loader wrapped into a new epoch
        assert len(r["repeating"]) == 6 and all(len(b) == 2 for b in r["repeating"])
    shard0, shard1 = (set(r["epochs"][0]) for r in results)
    assert not shard0 & shard1 and shard0 | shard1 == set(range(16))
    assert r0["epochs"][0] != r0["epochs"][1]  # reshuffled


def _no_sync_cases(_: int) -> dict:
    """bf16 at stage 0 keeps fp32 gradients in its buckets, not in `.grad`: the accessor reads them there."""
    import torch.distributed as dist

    import shardspeed
    from shardspeed.utils import safe_get_full_grad

    out = {}
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config={**base_config(), "bf16": {"enabled": True}})
    rank, world = dist.get_rank(), dist.get_world_size()
    data = token_batches(2, engine.train_batch_size())
    with engine.no_sync():
        engine.backward(engine(micro_batch(data, 0, 0, rank, world, 2)))
        local = safe_get_full_grad(engine.module.tok.weight)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    out["local_grads"] = (local.dtype, local.norm().item() > 0, not torch.equal(gathered[0], gathered[1]))
    stage2, *_ = shardspeed.initialize(
        model=TinyGPT(), config={**base_config(), "zero_optimization": {"stage": 2}}
    )
    try:
        with stage2.no_sync():
            pass
    except AssertionError as err:
        out["stage2"] = str(err)
    return out


def test_no_sync_keeps_gradients_local_and_refuses_what_deepspeed_refuses():
    r0, _ = run_ranks(_no_sync_cases, 2, 0)
    assert r0["local_grads"] == (torch.float32, True, True)
    assert "no_sync context manager is incompatible with ZeRO stage 2 or 3" in r0["stage2"]


def _config_errors(_: int) -> dict:
    import shardspeed

    out = {}
    for name, kwargs in {
        "no_config": {},
        "both_configs": {"args": argparse.Namespace(deepspeed_config="x.json"), "config": base_config()},
        "bad_optimizer_object": {"optimizer": 5, "config": base_config()},
    }.items():
        try:
            shardspeed.initialize(model=TinyGPT(), **kwargs)
        except (shardspeed.ConfigError, TypeError) as err:
            out[name] = str(err)
    return out


def test_initialize_refuses_bad_arguments():
    (out,) = run_ranks(_config_errors, 1, 0)
    assert "deepspeed_config" in out["no_config"]
    assert "twice" in out["both_configs"]
    assert "optimizer" in out["bad_optimizer_object"]


def test_initialize_without_a_model_raises_what_deepspeed_and_python_code_catch():
    import pytest

    import shardspeed

    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="needs a model"):
            shardspeed.initialize(model=None, config=base_config())
    # DeepSpeed's first positional argument is `args`: a model passed there is named in the message
    with pytest.raises(AssertionError, match="pass model="):
        shardspeed.initialize(TinyGPT(), config=base_config())


def _generator_parameters(_: int) -> list[int]:
    import shardspeed

    model = TinyGPT()
    # `model.parameters()` is a generator, as most DeepSpeed scripts pass it: checking the config's optimizer
    # block before the process group exists must not use it up
    _, optimizer, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=base_config()
    )
    return [len(g["params"]) for g in optimizer.param_groups]


def test_model_parameters_may_be_a_generator():
    (counts,) = run_ranks(_generator_parameters, 1, 0)
    assert sum(counts) == len(list(TinyGPT().parameters()))


def test_deepspeed_config_error_alias():
    import shardspeed

    assert shardspeed.DeepSpeedConfigError is shardspeed.ConfigError
    assert issubclass(shardspeed.ConfigError, ValueError)
    assert "initialize" in shardspeed.__all__
