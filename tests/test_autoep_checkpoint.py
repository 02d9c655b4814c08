"""Checkpoints of a model with AutoEP layers: each expert in its own file under its global index (DeepSpeed's
layout), bit-exact resume at the same layout, and loading at another ep size, world size or ZeRO stage."""

from __future__ import annotations

import pytest
import torch
from autoep_common import EXPERTS, LR, build, data

from harness import run_ranks

STEPS, GLOBAL_BATCH = 4, 4  # two steps before the save, two after


def _engine(stage: int, ep: int, world: int):
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": ep,
            "preset_model": "mixtral",
            "use_grouped_mm": False,
        },
    }
    engine, *_ = shardspeed.initialize(
        model=build(), optimizer=lambda params: torch.optim.Adam(params, lr=LR), config=config
    )
    return engine


def _train(engine, steps, world: int) -> list[float]:
    import torch.distributed as dist

    micro = GLOBAL_BATCH // world
    part = slice(dist.get_rank() * micro, (dist.get_rank() + 1) * micro)
    xs, ys = data(STEPS, GLOBAL_BATCH)
    losses = []
    for step in steps:
        loss = engine(xs[step, part], ys[step, part])
        engine.backward(loss)
        engine.step()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(summed.item() / world)  # the global batch's loss
    return losses


def _state(engine) -> dict[str, torch.Tensor]:
    """Every weight, the experts as whole [EXPERTS, ...] tensors in global order (gathered over the ep group)."""
    import torch.distributed as dist

    from shardspeed.moe.autoep.layer import AutoEPMoELayer

    layer = next(m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer))
    state = {n: p.detach().clone() for n, p in engine.module.named_parameters() if ".experts." not in n}
    for name in ("w1", "w2", "w3"):
        local = getattr(layer.experts, name).detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(layer.ep_size)]
        dist.all_gather(pieces, local, group=layer.ep_group)
        state[name] = torch.cat(pieces)
    return state


def _save_and_resume(root: str):
    """2 ranks, ep 2, ZeRO 0 and 2: save after two steps; two more, uninterrupted and after a fresh load."""
    import os

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo", verbose=False)
    out = {}
    for stage in (0, 2):
        engine = _engine(stage, 2, 2)
        _train(engine, range(2), 2)
        engine.save_checkpoint(f"{root}/stage{stage}", tag="t")
        losses = _train(engine, range(2, STEPS), 2)
        uninterrupted = _state(engine)
        engine.destroy()
        resumed = _engine(stage, 2, 2)
        resumed.load_checkpoint(f"{root}/stage{stage}", tag="t")
        out[stage] = (losses, uninterrupted, _train(resumed, range(2, STEPS), 2), _state(resumed))
        resumed.destroy()
    out["files"] = sorted(os.listdir(f"{root}/stage2/t"))
    return out


def _load_elsewhere(root: str, layouts):
    """The ep-2 ZeRO-2 checkpoint of 2 ranks loaded at each (ep, stage) of `layouts`, then two more steps."""
    import torch.distributed as dist

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo", verbose=False)
    world = dist.get_world_size()
    out = {}
    for ep, stage in layouts:
        engine = _engine(stage, ep, world)
        engine.load_checkpoint(f"{root}/stage2", tag="t")
        out[(ep, stage)] = (_train(engine, range(2, STEPS), world), _state(engine), engine.global_steps)
        engine.destroy()
    return out


def _refusals(root: str):
    """A checkpoint of another model's AutoEP layers, and one missing an expert file: refused on every rank,
    naming the problem, with the live weights untouched."""
    import os
    import shutil

    import shardspeed
    from shardspeed.checkpoint.files import CheckpointError

    shardspeed.init_distributed(dist_backend="gloo", verbose=False)
    engine = _engine(2, 2, 2)
    before = _state(engine)
    messages = []
    bad = f"{root}/bad"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(f"{root}/stage2", bad)
        state = torch.load(f"{bad}/t/mp_rank_00_model_states.pt", weights_only=True)
        state["ds_autoep_layers"][0]["num_experts"] = 8
        torch.save(state, f"{bad}/t/mp_rank_00_model_states.pt")
    torch.distributed.barrier()
    for damage in ("metadata", "missing expert"):
        if damage == "missing expert" and torch.distributed.get_rank() == 0:
            shutil.rmtree(bad)
            shutil.copytree(f"{root}/stage2", bad)
            os.remove(f"{bad}/t/layer_0_expert_3_mp_rank_00_model_states.pt")
        torch.distributed.barrier()
        try:
            engine.load_checkpoint(bad, tag="t")
            messages.append("loaded")
        except CheckpointError as error:
            messages.append(str(error))
    after = _state(engine)
    engine.destroy()
    return messages, all(torch.equal(before[k], after[k]) for k in before)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_autoep_checkpoint_resume_and_reshard(tmp_path):
    from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
    from shardspeed.checkpoint.files import CheckpointError
    from shardspeed.compat.mirrors import checkpoint_constants as constants

    ranks = run_ranks(_save_and_resume, 2, str(tmp_path), timeout=600)
    files = ranks[0]["files"]
    for e in range(EXPERTS):  # one file per expert, global index, as DeepSpeed writes them
        assert f"layer_0_expert_{e}_mp_rank_00_model_states.pt" in files
    expert = torch.load(tmp_path / "stage2/t/layer_0_expert_3_mp_rank_00_model_states.pt", weights_only=True)
    assert sorted(expert) == [f"model.layers.0.mlp.experts.{w}.3" for w in ("w1", "w2", "w3")]
    assert expert["model.layers.0.mlp.experts.w1.3"].dim() == 2  # one expert, not the stacked tensor
    model_states = torch.load(tmp_path / "stage2/t/mp_rank_00_model_states.pt", weights_only=True)
    assert not any(".experts." in k for k in model_states["module"])  # experts only in their files
    (entry,) = model_states[
        constants.AUTOEP_LAYERS_KEY
    ]  # DeepSpeed's entry, under deepspeed.checkpoint's names
    assert set(constants.AUTOEP_ZERO12_REQUIRED_FIELDS) <= set(entry)
    assert entry[constants.AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY] == "per_expert_files"
    assert entry["module_path"] == "model.layers.0.mlp" and entry[constants.AUTOEP_NUM_EXPERTS] == EXPERTS
    assert entry[constants.AUTOEP_NUM_LOCAL_EXPERTS] * entry[constants.AUTOEP_EP_SIZE] == EXPERTS
    for stage in (0, 2):  # same layout: bit for bit
        for losses, uninterrupted, resumed_losses, resumed in (r[stage] for r in ranks):
            assert resumed_losses == losses, stage
            assert _max_diff(resumed, uninterrupted) == 0, stage
    losses, expected = ranks[0][2][0], ranks[0][2][1]  # ZeRO-2, ep 2, 2 ranks, uninterrupted

    elsewhere = {}
    for world, layouts in ((2, [(1, 0), (2, 1)]), (1, [(1, 2)])):
        for result in run_ranks(_load_elsewhere, world, str(tmp_path), layouts, timeout=600):
            elsewhere.update({(world, *k): v for k, v in result.items()})
    for layout, (resumed_losses, state, steps) in elsewhere.items():
        assert steps == STEPS, layout
        assert max(abs(a - b) for a, b in zip(resumed_losses, losses)) < 1e-6, (
            layout,
            resumed_losses,
            losses,
        )
        assert _max_diff(state, expected) < 1e-6, layout

    # consolidation reads by name through CheckpointReader, which does not read MoE files: refused, saying so
    with pytest.raises(CheckpointError, match="model with MoE layers"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "stage2")
    for messages, untouched in run_ranks(_refusals, 2, str(tmp_path), timeout=300):
        assert untouched
        assert "AutoEP layers" in messages[0] and "'num_experts': 8" in messages[0], messages[0]
        assert "layer_0_expert_3_mp_rank_00_model_states.pt" in messages[1], messages[1]


def test_an_expert_file_that_is_missing_or_from_another_module_is_refused_naming_it(tmp_path):
    from shardspeed.checkpoint import files
    from shardspeed.checkpoint.files import CheckpointError
    from shardspeed.moe.autoep_checkpoint import load_expert_file

    name = "layer_0_expert_1_mp_rank_00_model_states.pt"
    with pytest.raises(CheckpointError, match=f"has no {name} \\(expert 1 of MoE layer 0\\)"):
        load_expert_file(tmp_path / name, 0, 1, ["a.w1.1"])
    files.save_file({"a.w1.1": torch.ones(2)}, tmp_path / name)
    assert torch.equal(load_expert_file(tmp_path / name, 0, 1, ["a.w1.1"])["a.w1.1"], torch.ones(2))
    with pytest.raises(CheckpointError, match=r"lacks \['b.w2.1'\]: not expert 1"):
        load_expert_file(tmp_path / name, 0, 1, ["a.w1.1", "b.w2.1"])
