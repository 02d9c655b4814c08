"""AutoEP folded onto AutoTP: training through the engine gives the one-process model's losses, clipped
gradient norms and parameters (SGD, fp32, 1e-5) — on 2 ranks (tensor 2, expert 2, one data replica) at ZeRO 0,
1 and 2, and on 4 ranks (two replicas) with expert groups inside a tensor group or spanning two; and the
restore's gather has the gradient of the unsplit combine."""

from __future__ import annotations

from pathlib import Path

import torch
from autoep_common import EXPERTS, FFN, TOKENS, H, MixtralBlockLike, MixtralConfigLike
from torch import nn

from harness import run_ranks

STEPS, BATCH = 3, 4
# SGD, not Adam: Adam's update hardly depends on a gradient's scale, so a gradient counted once per tensor lane
# (the folded layer's factor t) would go unseen; SGD's update is the gradient itself.
SGD_LR = 0.2


class FoldedTiny(nn.Module):
    """A tensor-parallel MLP (up: column, down: row) -> a Mixtral-like MoE block -> a replicated head."""

    def __init__(self):
        super().__init__()
        self.config = MixtralConfigLike()
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)
        self.model = nn.Module()
        layer = nn.Module()
        layer.mlp = MixtralBlockLike()
        self.model.layers = nn.ModuleList([layer])
        self.head = nn.Linear(H, H)

    def forward(self, x, y):
        h = x + self.down(torch.tanh(self.up(x)))
        return ((self.head(h + self.model.layers[0].mlp(h)) - y) ** 2).mean()


def _build() -> FoldedTiny:
    torch.manual_seed(0)
    return FoldedTiny()


def _data():
    gen = torch.Generator().manual_seed(11)
    return torch.randn(STEPS, BATCH, TOKENS, H, generator=gen), torch.randn(
        STEPS, BATCH, TOKENS, H, generator=gen
    )


def _compared(model) -> dict[str, torch.Tensor]:
    """The replicated weights and the experts as w1 / w3 / w2 over all experts, in the source's layout."""
    mlp = model.model.layers[0].mlp
    state = {"head": model.head.weight.detach().clone()}
    if hasattr(mlp, "router"):
        state["router"] = mlp.router.gate.weight.detach().clone()
        state.update(w1=mlp.experts.w1.detach(), w3=mlp.experts.w3.detach(), w2=mlp.experts.w2.detach())
    else:
        state["router"] = mlp.gate.weight.detach().clone()
        gate_up = mlp.experts.gate_up_proj.detach()
        state.update(
            w1=gate_up[:, :FFN].clone(), w3=gate_up[:, FFN:].clone(), w2=mlp.experts.down_proj.detach()
        )
    return state


def _reference():
    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    xs, ys = _data()
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(xs[step], ys[step])
        loss.backward()
        # the engine clips at gradient_clipping's default, 1.0: the folded norm must count every shard once
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        losses.append(loss.item())
        opt.step()
    return losses, norms, _compared(model)


_TP_RULES = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r"^up\.weight$"], "partition_type": "column"},
        {"patterns": [r"^down\.weight$"], "partition_type": "row"},
        {"patterns": [r"^head\.weight$", r".*\.gate\.weight$"], "partition_type": "skip"},
    ],
}


def _train(stage: int, folder: str, ep: int = 2) -> dict:
    """Train on this rank's tensor group's share of each batch (its data replica); the loss reported is the
    mean over the replicas, the experts gathered over its expert group in global order."""
    import torch.distributed as dist

    import shardspeed

    replicas = dist.get_world_size() // 2
    config = {
        "train_micro_batch_size_per_gpu": BATCH // replicas,
        "zero_allow_untested_optimizer": True,  # SGD is per element, so stepping shards is stepping tensors
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
        "tensor_parallel": {"autotp_size": 2, "partition_config": _TP_RULES},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "use_grouped_mm": False, "validate_folding_routing": True},
    }  # fmt: skip
    engine, *_ = shardspeed.initialize(
        model=_build(), optimizer=lambda params: torch.optim.SGD(params, lr=SGD_LR), config=config
    )
    layer = engine.module.model.layers[0].mlp
    assert layer.folding is not None and layer.num_local_experts == EXPERTS // ep
    assert type(engine.module.up).__name__ != "Linear"  # sharded by AutoTP
    xs, ys = _data()
    replica = dist.get_rank() // 2  # tensor ranks are neighbours: ranks 2r and 2r + 1 are replica r's lanes
    mine = slice(replica * BATCH // replicas, (replica + 1) * BATCH // replicas)
    losses, norms = [], []
    for step in range(STEPS):
        loss = engine(xs[step, mine], ys[step, mine])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        norms.append(engine.get_global_grad_norm())
    try:  # refused on every rank, and nothing published
        engine.save_checkpoint(folder)
        refused = False
    except Exception as error:  # the engine reports every failing rank (CheckpointError)
        refused = "AutoEP folded onto AutoTP" in str(error)
    assert refused and not (Path(folder) / "latest").exists()
    state = _compared(engine.module)
    # each expert group (ep consecutive ranks) holds every expert once: gather them in global order
    world = dist.get_world_size()
    expert_groups = [dist.new_group(list(range(first, first + ep))) for first in range(0, world, ep)]
    for name in ("w1", "w2", "w3"):
        pieces = [torch.empty_like(state[name]) for _ in range(ep)]
        dist.all_gather(pieces, state[name].contiguous(), group=expert_groups[dist.get_rank() // ep])
        state[name] = torch.cat(pieces)
    engine.destroy()
    return {"losses": losses, "norms": norms, "state": state}


def _train_all_stages(folder: str):
    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo", verbose=False)
    return {f"stage {stage}": _train(stage, folder) for stage in (0, 1, 2)}


def _train_four_ranks(folder: str):
    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo", verbose=False)
    return {f"ep {ep}, stage {stage}": _train(stage, folder, ep) for ep, stage in ((2, 1), (4, 2))}


def _check(results, losses, norms, expected, initial) -> None:
    for rank in results:
        for run, result in rank.items():
            torch.testing.assert_close(result["losses"], losses, rtol=1e-5, atol=1e-5, msg=f"{run}: losses")
            torch.testing.assert_close(result["norms"], norms, rtol=1e-5, atol=1e-5, msg=f"{run}: norms")
            for name, tensor in result["state"].items():
                torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-5, msg=f"{run}: {name}")
            assert not torch.equal(result["state"]["w1"], initial["w1"])  # the experts did train


def test_folded_training_matches_one_process_at_zero_0_1_2(tmp_path):
    _check(run_ranks(_train_all_stages, 2, str(tmp_path), timeout=300), *_reference(), _compared(_build()))


def test_folded_training_on_four_ranks_two_replicas(tmp_path):
    """World 4, tensor 2: two data replicas. ep 2 (ZeRO 1): each expert group is one tensor group, the experts
    replicated across the replicas (expert-data-parallel 2); ep 4 (ZeRO 2): the expert group spans both
    replicas' lanes."""
    _check(run_ranks(_train_four_ranks, 4, str(tmp_path), timeout=300), *_reference(), _compared(_build()))


def _restore_gradient() -> dict:
    """Two lanes, different losses per lane: the gradients summed over the lanes are those of the sum of the
    losses over the unsplit combine (the gather's backward is a reduce-scatter)."""
    import torch.distributed as dist

    from shardspeed.moe.autoep import ep_tp_dispatch as dispatch
    from shardspeed.moe.autoep import folding_grads

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    experts = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    tokens, slots = torch.tensor([0, 1, 3, 0, 2, 1, 3]), torch.tensor([0, 0, 1, 1, 0, 1, 0])
    scores = torch.linspace(0.2, 0.8, 7, requires_grad=True)
    values = torch.arange(21.0).reshape(7, 3).div(7).requires_grad_(True)
    payload = dispatch.RoutedAssignmentPayload(
        tokens, experts, dispatch.assignment_ordinals_by_expert(experts), slots, scores,
        torch.zeros(7, dtype=torch.bool), torch.zeros(7, dtype=torch.bool), [3, 2, 2], [3, 2, 2],
        {"destination_ranks": experts, "num_tokens": 4},
    )  # fmt: skip
    _, ctx = dispatch.partition_assignments(payload, tp_group=group, tp_rank=rank, tp_size=2)
    dispatch.assert_tp_payload_consistent(payload, tp_group=group, tp_size=2)
    restored = dispatch.restore_combined(
        values[ctx.local_indices], ctx, tp_group=group, validate_coverage=True
    )
    (restored * (rank + 1)).square().sum().backward()
    grads = torch.cat([values.grad.reshape(-1), scores.grad])
    dist.all_reduce(grads)
    # the same on one process: the whole combine, the sum of both lanes' losses
    values_ref, scores_ref = (
        values.detach().clone().requires_grad_(True),
        scores.detach().clone().requires_grad_(True),
    )
    combined = torch.zeros(4, 3).index_add(0, tokens, values_ref * scores_ref[:, None])
    sum((combined * (lane + 1)).square().sum() for lane in range(2)).backward()
    expected = torch.cat([values_ref.grad.reshape(-1), scores_ref.grad])
    # the families' reductions over the lanes: average, sum, expert cancellation
    spec = type("Spec", (), {"tp_size": 2, "mp_mode": "tp"})()
    router, partial, expert = (
        nn.Parameter(torch.zeros(1)),
        nn.Parameter(torch.zeros(1)),
        nn.Parameter(torch.zeros(1)),
    )
    folding_grads.mark_autoep_folding_partial_router_parameter(partial)
    expert.allreduce = False
    reduced = []
    for param in (router, partial, expert):
        grad = torch.tensor([float(rank + 1)], dtype=torch.bfloat16 if param is router else torch.float32)
        folding_grads.reduce_autoep_folding_gradient(spec, param, grad, tp_group=group)
        reduced.append(grad.float().item())
    payload.capacity_slots = payload.capacity_slots.clone()
    if rank == 1:
        payload.capacity_slots[0] = 1  # this lane routed differently
    try:
        dispatch.assert_tp_payload_consistent(payload, tp_group=group, tp_size=2)
        diverged = False
    except RuntimeError:
        diverged = True
    return {"restored": (restored - combined.detach()).abs().max().item(), "grads": grads, "expected": expected,
            "reduced": reduced, "diverged": diverged}  # fmt: skip


def test_restore_gradient_and_family_reductions_over_two_lanes():
    for rank, result in enumerate(run_ranks(_restore_gradient, 2)):
        assert result["restored"] < 1e-6
        torch.testing.assert_close(result["grads"], result["expected"], rtol=1e-6, atol=1e-6)
        assert result["reduced"] == [1.5, 3.0, (rank + 1) / 2]  # average, sum, divided by the lanes
        assert result["diverged"]
