"""The ZeRO user API: GatheredParameters, safe_get/set accessors, save_16bit_model, generation context."""

import torch

from common import base_config, full_params, train_engine
from harness import run_ranks
from models import TinyGPT, token_batches


def _engine(stage: int, **zero):
    import shardspeed

    torch.manual_seed(0)
    config = base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 3000,
                                            "stage3_param_persistence_threshold": 0, **zero})  # fmt: skip
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config=config)
    return engine


def _api_cases(root: str) -> dict:
    import torch.distributed as dist

    from shardspeed import zero

    out = {}
    engines = {0: _engine(0), 3: _engine(3, stage3_gather_16bit_weights_on_model_save=True)}
    rank, world = dist.get_rank(), dist.get_world_size()
    for stage, engine in engines.items():
        data = token_batches(3, engine.train_batch_size())
        train_engine(engine, data, range(2), rank, world)
        # Two micro-batches, the second on the accumulation boundary, without the optimizer step: the
        # averaged gradients are there to read.
        engine.backward(engine(data[2, rank * 2 : rank * 2 + 2]))
        engine.step()
        engine.backward(engine(data[2, 4 + rank * 2 : 4 + rank * 2 + 2]))
        weight = engine.module.blocks[0].mlp[0].weight
        out[stage] = {
            "fp32": zero.safe_get_full_fp32_param(weight),
            "grad": zero.safe_get_full_grad(weight),
            "exp_avg": zero.safe_get_full_optimizer_state(weight, "exp_avg"),
            "params": full_params(engine),
            "saved": engine.save_16bit_model(f"{root}/stage{stage}"),
        }
        engine.zero_grad()
    engine = engines[3]
    out["released_outside_forward"] = engine.module.blocks[0].mlp[0].weight.numel()

    # Generation with everything gathered once; the result equals a plain forward on the full weights.
    probe = token_batches(1, 2, seed=99)[0]

    def module_hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules())

    offload = engine.optimizer.parameter_offload
    out["hooks"] = [(len(offload.forward_hooks), module_hooks())]
    with torch.no_grad(), zero.unwrap_model_for_generation(engine) as module:
        out["numel_inside"] = module.blocks[0].mlp[0].weight.numel()
        out["hooks"].append((len(offload.forward_hooks), module_hooks()))  # taken off, as DeepSpeed does
        out["loss_inside"] = module(probe).item()
    out["numel_after"] = engine.module.blocks[0].mlp[0].weight.numel()
    out["hooks"].append((len(offload.forward_hooks), module_hooks()))  # put back
    out["order_after"] = offload.param_coordinator.is_invalid_trace()  # re-recorded over the next step

    # Modify a parameter on rank 0 only; every rank and the fp32 master see it after the block.
    weight = engine.module.blocks[0].mlp[0].weight
    with zero.GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)
    out["after_modify_master"] = zero.safe_get_full_fp32_param(weight)
    with zero.GatheredParameters([weight]):
        out["after_modify_param"] = weight.detach().clone()
    zero.safe_set_full_fp32_param(weight, torch.full(weight.shape if weight.numel() else (128, 32), 0.25))
    out["after_set"] = zero.safe_get_full_fp32_param(weight)
    train_engine(engine, token_batches(1, engine.train_batch_size()), range(1), rank, world)  # still trains
    out["unmanaged"] = zero.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
    return out


def test_zero_user_api(tmp_path):
    results = run_ranks(_api_cases, 2, str(tmp_path))
    r = results[0]
    for key in ("fp32", "grad", "exp_avg"):
        assert r[3][key] is not None and r[3][key].shape == (128, 32)
        assert (r[3][key] - r[0][key]).abs().max() <= 1e-5, key  # stage 3 shards assemble stage 0's values
    assert torch.equal(r[3]["fp32"], r[3]["params"]["blocks.0.mlp.0.weight"])
    assert r[0]["saved"] and r[3]["saved"]
    for stage in (0, 3):
        saved = torch.load(tmp_path / f"stage{stage}" / "pytorch_model.bin", weights_only=True)
        model = TinyGPT()
        model.load_state_dict(saved, strict=True)  # every key, tied head.weight included
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), r[stage]["params"][name]), name
    assert r["released_outside_forward"] == 0
    assert r["numel_inside"] == 128 * 32 and r["numel_after"] == 0
    (handles, hooks), inside, after = r["hooks"]
    assert handles > 0 and handles == hooks and inside == (0, 0) and after == (handles, hooks)
    assert r["order_after"]  # the hooks were put back at the root: the gather order is recorded anew
    reference = TinyGPT()
    reference.load_state_dict({k: v for k, v in r[3]["params"].items()}, strict=False)
    reference.head.weight = reference.tok.weight
    assert abs(reference(token_batches(1, 2, seed=99)[0]).item() - r["loss_inside"]) <= 1e-5
    for rank_result in results:
        assert torch.equal(rank_result["after_modify_master"], torch.full((128, 32), 0.5))
        assert torch.equal(rank_result["after_modify_param"], torch.full((128, 32), 0.5))
        assert torch.equal(rank_result["after_set"], torch.full((128, 32), 0.25))
    assert r["unmanaged"] is None


def _export_refused(root: str) -> bool:
    return _engine(3).save_16bit_model(root)


def test_save_16bit_model_needs_the_gather_flag_under_stage3(tmp_path):
    assert run_ranks(_export_refused, 2, str(tmp_path)) == [False, False]
    assert not (tmp_path / "pytorch_model.bin").exists()


def _taken_views() -> dict:
    import shardspeed

    engine = _engine(3, stage3_param_persistence_threshold=0)
    engine.backward(engine(token_batches(1, 4)[0][:2]))
    engine.step()
    taken, copies = {}, {}
    for name, p in engine.module.named_parameters():
        with shardspeed.zero.GatheredParameters(p):
            taken[name], copies[name] = p.detach(), p.detach().clone()
    released = all(p.numel() == 0 for p in engine.module.parameters())
    engine.backward(engine(token_batches(1, 4)[0][:2]))  # the units gather and release again
    engine.step()
    return {"kept": all(torch.equal(taken[n], copies[n]) for n in taken), "released": released}


def test_tensors_taken_inside_gathered_parameters_keep_their_values():
    """As in DeepSpeed: `p.detach()` inside the block stays valid after it (the buffer is let go, not
    freed in place); the parameters themselves are released."""
    for result in run_ranks(_taken_views, 2):
        assert result == {"kept": True, "released": True}
