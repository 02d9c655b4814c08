"""AutoEP at ep 2 on 2 ranks: the layer matches the source block (outputs and gradients), and training through
the engine at ZeRO 0, 1 and 2 reaches the one-process model's parameters."""

from __future__ import annotations

import torch
from autoep_common import EXPERTS, LR, build, data, grouped_state, reference_run

from harness import run_ranks

STEPS, MICRO = 3, 2


def _layer_parity():
    """Each rank routes its own tokens through the ep-2 layer; compare with the source block on those tokens."""
    import torch.distributed as dist

    from shardspeed.moe.autoep import AutoEP, parse_autoep_config
    from shardspeed.moe.groups import build_expert_groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reference = build().model.layers[0].mlp
    model = build()
    auto_ep = AutoEP(model, parse_autoep_config({"enabled": True, "autoep_size": 2, "use_grouped_mm": False}))
    layer = auto_ep.replace_moe_layer(auto_ep.ep_parser()[0], ep_size=2, ep_rank=rank)
    layer.set_deepspeed_parallelism(groups=build_expert_groups([2]))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(rank))
    out = layer(x)
    out.square().sum().backward()
    expected = reference(x)
    expected.square().sum().backward()
    # expert grads: the owner's gradient sums every rank's tokens; the reference's is this rank's share only
    local = EXPERTS // 2
    mine = slice(rank * local, (rank + 1) * local)
    ref_grads = reference.experts.gate_up_proj.grad.clone()
    dist.all_reduce(
        ref_grads
    )  # the whole tensor (each rank must reduce the same one), then this rank's slice
    ref_grads = ref_grads[mine]
    w1_w3 = torch.cat((layer.experts.w1.grad, layer.experts.w3.grad), dim=1)
    return {
        "out": (out - expected).abs().max().item(),
        "router": (layer.router.gate.weight.grad - reference.gate.weight.grad).abs().max().item(),
        "experts": (w1_w3 - ref_grads).abs().max().item(),
        "local_experts": layer.num_local_experts,
    }


def test_ep2_layer_matches_the_source_block_outputs_and_gradients():
    for rank in run_ranks(_layer_parity, 2):
        assert rank["local_experts"] == 2
        assert rank["out"] < 1e-5 and rank["router"] < 1e-5 and rank["experts"] < 1e-5, rank


def _train(stage: int):
    import torch.distributed as dist

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 2,
            "preset_model": "mixtral",
            "use_grouped_mm": False,
        },
    }
    engine, *_ = shardspeed.initialize(
        model=build(), optimizer=lambda params: torch.optim.Adam(params, lr=LR), config=config
    )
    xs, ys = data(STEPS, MICRO * 2)
    for step in range(STEPS):
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(xs[step, part], ys[step, part]))
        engine.step()
    state = grouped_state(engine.module)
    for name in ("w1", "w2", "w3"):  # every rank's experts, in global order
        pieces = [torch.empty_like(state[name]) for _ in range(2)]
        dist.all_gather(pieces, state[name].contiguous())
        state[name] = torch.cat(pieces)
    engine.destroy()
    return state


def _train_all_stages():
    return {stage: _train(stage) for stage in (0, 1, 2)}


def test_ep2_training_matches_one_process_at_zero_0_1_2():
    expected = reference_run(STEPS, MICRO, 2)
    initial = grouped_state(build())
    for rank in run_ranks(_train_all_stages, 2, timeout=300):
        for stage, state in rank.items():
            assert state.keys() == expected.keys()
            for name, tensor in expected.items():
                torch.testing.assert_close(
                    state[name], tensor, rtol=1e-5, atol=1e-5, msg=f"stage {stage}: {name}"
                )
            assert not torch.equal(state["w1"], initial["w1"])  # the experts did train
