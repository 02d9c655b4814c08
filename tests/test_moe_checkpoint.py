"""MoE checkpoints: expert files by global index, bit-exact resume, and loading at another ep size."""

from __future__ import annotations

import torch

from harness import run_ranks
from moe_common import EXPERTS, LR, build, data, full_state

STEPS = 4  # two before the save, two after


def _engine(stage: int, ep: int, micro: int, **zero):
    import shardspeed

    model = build(ep, _ep_rank(ep), 2, False, aux=0.0)  # top-2, no dropping: routing is per token
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **zero}}  # fmt: skip
    engine, *_ = shardspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR), config=cfg
    )
    return engine


def _ep_rank(ep: int) -> int:
    import torch.distributed as dist

    return dist.get_rank() % ep  # expert-parallel groups are consecutive data ranks


def _train(engine, steps, micro: int):
    import torch.distributed as dist

    rank = dist.get_rank()
    xs, ys = data(STEPS, 4)
    for step in steps:
        sl = slice(rank * micro, (rank + 1) * micro)
        engine.backward(engine(xs[step, sl], ys[step, sl]))
        engine.step()


def _state(engine, ep: int) -> dict:
    from shardspeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return full_state(engine.module, ep, _ep_rank(ep))


def _save_and_resume(root: str):
    """2 ranks, ep 2: save after two steps; two more steps, uninterrupted and after a fresh load."""
    import os

    import shardspeed

    shardspeed.init_distributed()
    out = {}
    for stage in (0, 1, 2, 3):
        engine = _engine(stage, 2, 2)
        _train(engine, range(2), 2)
        engine.save_checkpoint(f"{root}/stage{stage}", tag="t")
        saved = _state(engine, 2)
        _train(engine, range(2, STEPS), 2)
        uninterrupted = _state(engine, 2)
        engine.destroy()
        resumed = _engine(stage, 2, 2)
        resumed.load_checkpoint(f"{root}/stage{stage}", tag="t")
        _train(resumed, range(2, STEPS), 2)
        out[stage] = (saved, uninterrupted, _state(resumed, 2), resumed.global_steps)
        resumed.destroy()
    out["files"] = sorted(os.listdir(f"{root}/stage2/t"))
    return out


def _load_elsewhere(root: str):
    """4 ranks: the ep 2 checkpoint (2 ranks, ZeRO-2) loaded at ep 4 and at ep 1, then two more steps;
    and the memory of expert optimizer state at ep 2 over 4 ranks."""
    import shardspeed

    shardspeed.init_distributed()
    out = {}
    for ep, stage in ((4, 2), (1, 3)):
        engine = _engine(stage, ep, 1)
        engine.load_checkpoint(f"{root}/stage2", tag="t")
        loaded = _state(engine, ep)
        _train(engine, range(2, STEPS), 1)
        out[ep] = (loaded, _state(engine, ep), engine.global_steps)
        engine.destroy()
    engine = _engine(2, 2, 1)
    moe = engine.module.moe
    expert_numel = sum(p.numel() for p in moe.deepspeed_moe.experts.parameters())
    dense_numel = sum(p.numel() for p in engine.module.parameters()) - expert_numel
    _train(engine, range(1), 1)
    out["memory"] = (engine.memory_breakdown()["optimizer_state"], dense_numel, expert_numel)
    engine.destroy()
    # ZeRO-3: parameters too are divided, experts over their 2-rank group (none kept gathered)
    engine = _engine(3, 2, 1, stage3_param_persistence_threshold=0)
    _train(engine, range(1), 1)
    out["memory3"] = engine.memory_breakdown()
    engine.destroy()
    return out


def _merge(per_rank: list[dict]) -> dict:
    merged = {}
    for state in per_rank:
        merged.update(state)
    return merged


def test_moe_checkpoint_resume_and_reshard(tmp_path):
    ranks = run_ranks(_save_and_resume, 2, str(tmp_path), timeout=600)
    files = ranks[0]["files"]
    for e in range(EXPERTS):  # DeepSpeed's expert files, global expert index
        assert f"layer_0_expert_{e}_mp_rank_00_model_states.pt" in files
    saved_expert = torch.load(
        tmp_path / "stage2/t/layer_0_expert_3_mp_rank_00_model_states.pt", weights_only=True
    )
    assert sorted(saved_expert) == sorted(f"moe.deepspeed_moe.experts.deepspeed_experts.3.{n}"
                                          for n in ("up.weight", "up.bias", "down.weight", "down.bias"))  # fmt: skip
    model_states = torch.load(tmp_path / "stage2/t/mp_rank_00_model_states.pt", weights_only=False)
    assert not any("deepspeed_experts" in k for k in model_states["module"])  # experts only in their files
    assert model_states["num_experts"] == [EXPERTS]
    for stage in (0, 1, 2, 3):
        per_rank = [r[stage] for r in ranks]
        uninterrupted = _merge([r[1] for r in per_rank])
        resumed = _merge([r[2] for r in per_rank])
        assert per_rank[0][3] == STEPS
        for name, value in uninterrupted.items():
            assert torch.equal(resumed[name], value), f"stage {stage}: {name} not bit-exact after resume"
    saved = _merge([r[2][0] for r in ranks])
    expected = _merge([r[2][1] for r in ranks])  # the 2-rank run, continued without interruption

    elsewhere = run_ranks(_load_elsewhere, 4, str(tmp_path), timeout=600)
    for ep in (4, 1):
        loaded = _merge([r[ep][0] for r in elsewhere])
        continued = _merge([r[ep][1] for r in elsewhere])
        assert elsewhere[0][ep][2] == STEPS
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), f"ep {ep}: {name} differs from the saved value"
        for name, value in expected.items():  # same global batches, optimizer state carried over
            torch.testing.assert_close(
                continued[name], value, rtol=0, atol=1e-5, msg=f"ep {ep} continued: {name}"
            )
    # ZeRO-2 at ep 2 on 4 ranks: dense state over 4 ranks, expert state over the 2-rank expert-data group;
    # Adam keeps 8 bytes per element, plus padding to the group size and a 4-byte step per bucket.
    measured, dense, experts = elsewhere[0]["memory"]
    formula = 8 * (dense / 4 + experts / 2)
    assert formula <= measured <= formula + 8 * 3 * 40 + 4 * 40, (measured, formula)
    stage3 = elsewhere[0]["memory3"]
    formula = 4 * (dense / 4 + experts / 2)  # fp32 parameter shards (gathered ones are released)
    assert formula <= stage3["params"] <= formula + 4 * 3 * 40, (stage3, formula)
    assert 2 * formula <= stage3["optimizer_state"] <= 2 * formula + 8 * 3 * 40 + 4 * 40, (stage3, formula)
