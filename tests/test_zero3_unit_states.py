"""ZeRO-3 parameter units as a state machine (zero/param_units.py, [Note: stage 3 lifecycle]): the legal
transitions, an illegal one refused by name, and `ds_status` telling the truth about the data (AVAILABLE:
the full value is there; NOT_AVAILABLE: only the shard, the parameter is empty; INFLIGHT: a gather into the
unit has been started and not yet waited on) after a training step and after an eval forward."""

import pytest
import torch
from torch import nn

from harness import run_ranks


def _unit_transitions() -> dict:
    import torch.distributed as dist

    from shardspeed.core.partitioned import ZeroParamStatus
    from shardspeed.zero.param_units import Awaiting, LiveNumel, ParamUnit, UnitState, UnitStateError

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    expected = {n: p.detach().clone() for n, p in layer.named_parameters()}
    params, names = list(layer.parameters()), [n for n, _ in layer.named_parameters()]
    live = LiveNumel()
    unit = ParamUnit(layer, params, names, 0, world, rank, None, False, live)
    seen = {}

    def record(label: str) -> None:
        seen[label] = (
            unit.state,
            [p.ds_status for p in params],
            [tuple(p.shape) for p in params],
            live.numel,
        )

    record("built")
    unit.gather(async_op=True, for_training=True)
    record("gather started")
    unit.wait_for_gather()
    record("gather finished")
    seen["values"] = all(torch.equal(p.detach(), expected[n]) for n, p in zip(names, params))
    unit.expect_gradients()
    seen["awaiting"] = (unit.awaiting, unit.idle)
    unit.gradients_done()
    seen["done"] = (unit.awaiting, unit.idle)
    unit.free()
    record("freed")
    unit.free()  # a released unit stays released
    record("freed twice")
    unit.gather(async_op=True)
    try:
        unit._enter(UnitState.RELEASED)  # freeing a buffer a collective is still filling
        seen["illegal"] = "no error"
    except UnitStateError as err:
        seen["illegal"] = str(err)
    record("after the refused transition")
    unit.free()  # waits for the gather, then releases
    record("freed while gathering")

    frozen_layer = nn.Linear(2, 2).requires_grad_(False)
    frozen = ParamUnit(frozen_layer, list(frozen_layer.parameters()), ["w", "b"], None, world, rank, None,
                       False, live)  # fmt: skip
    try:
        frozen.expect_gradients()
        seen["frozen"] = "no error"
    except UnitStateError as err:
        seen["frozen"] = str(err)

    persistent = ParamUnit(nn.Linear(2, 2), list(nn.Linear(2, 2).parameters()), ["w", "b"], 0, world, rank,
                           None, True, live)  # fmt: skip
    before = persistent.state
    persistent.refresh()  # GATHERED -> GATHERING -> GATHERED, never counted in `live`
    seen["persistent"] = (before, persistent.state, [p.ds_status for p in persistent.params], live.numel)
    seen["statuses"] = (ZeroParamStatus, Awaiting)
    return seen


def test_unit_transitions_publish_ds_status_and_refuse_illegal_ones():
    from shardspeed.core.partitioned import ZeroParamStatus as S
    from shardspeed.zero.param_units import Awaiting, UnitState

    for seen in run_ranks(_unit_transitions, 2):
        padded = 16  # 12 + 3 elements, padded to a multiple of 2 ranks
        empty = [(0,), (0,)]
        assert seen["built"] == (UnitState.RELEASED, [S.NOT_AVAILABLE] * 2, empty, 0)
        assert seen["gather started"] == (UnitState.GATHERING, [S.INFLIGHT] * 2, empty, padded)
        assert seen["gather finished"] == (UnitState.GATHERED, [S.AVAILABLE] * 2, [(3, 4), (3,)], padded)
        assert seen["values"]
        assert seen["awaiting"] == (Awaiting.GRADIENTS, False)
        assert seen["done"] == (Awaiting.NOTHING, True)
        message = seen["illegal"]
        assert "GATHERING -> RELEASED" in message and "weight" in message, message
        assert seen["after the refused transition"][:2] == (UnitState.GATHERING, [S.INFLIGHT] * 2)
        assert seen["freed"] == (UnitState.RELEASED, [S.NOT_AVAILABLE] * 2, empty, 0)
        assert seen["freed twice"] == seen["freed"] == seen["freed while gathering"]
        assert "NOTHING -> GRADIENTS" in seen["frozen"] and "frozen" in seen["frozen"]
        assert seen["persistent"] == (UnitState.GATHERED, UnitState.GATHERED, [S.AVAILABLE] * 2, 0)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
        )

    def forward(self, x):
        return self.layers(x)


def _truth(engine) -> dict:
    """Per parameter: its ds_status, whether its data agrees with it, and its unit's state."""
    from shardspeed.core.partitioned import ZeroParamStatus as S

    result = {}
    for name, p in engine.module.named_parameters():
        unit = p._shardspeed_unit
        full = tuple(p.shape) == tuple(p.ds_shape)
        agrees = {
            S.AVAILABLE: full,
            S.NOT_AVAILABLE: p.numel() == 0,
            S.INFLIGHT: unit.state.name == "GATHERING",
        }[p.ds_status]
        result[name] = (p.ds_status.name, agrees, unit.state.name, full)
    return result


def _engine_statuses(tied: bool) -> dict:
    import shardspeed

    from models import TinyGPT, token_batches

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=TinyGPT() if tied else _MLP(), config=config)
    x = token_batches(1, 2)[0] if tied else torch.randn(2, 8, generator=torch.Generator().manual_seed(1))

    def loss():
        out = engine(x)
        return out if tied else out.square().mean()

    seen = {}
    for step in range(2):
        engine.backward(loss())
        engine.step()
        seen[f"after step {step}"] = _truth(engine)
    loss()  # a training forward whose backward never comes (a step abandoned)
    seen["after training forward"] = _truth(engine)
    engine.eval()
    with torch.no_grad():
        loss()
    seen["after eval forward"] = _truth(engine)
    engine.empty_partition_cache()
    seen["after empty_partition_cache"] = _truth(engine)
    return seen


@pytest.mark.parametrize("tied", [False, True], ids=["mlp", "tied-gpt"])
def test_ds_status_tells_the_truth_after_training_and_eval(tied):
    for seen in run_ranks(_engine_statuses, 2, tied):
        for moment, params in seen.items():
            for name, (status, agrees, state, _) in params.items():
                assert agrees, f"{moment}: {name} is {status} while its unit is {state}"
        for moment in ("after step 0", "after step 1", "after empty_partition_cache"):
            assert {s for s, *_ in seen[moment].values()} == {"NOT_AVAILABLE"}, seen[moment]
        # An eval forward leaves nothing in flight and nothing gathered (nothing is persistent here), as
        # DeepSpeed after a no-grad forward: before, a tied head prefetched every block again and left them
        # INFLIGHT with empty data until the next backward.
        assert {s for s, *_ in seen["after eval forward"].values()} == {"NOT_AVAILABLE"}, seen[
            "after eval forward"
        ]
        training = seen["after training forward"]
        assert "INFLIGHT" not in {s for s, *_ in training.values()}, training


def _deepspeed_chat_save(tmp: str) -> dict:
    """DeepSpeed-Chat's `save_zero_three_model` (utils.py), as it is written there: it gathers only the
    parameters whose status is NOT_AVAILABLE and reads `.data` of the rest. Run after training steps and an
    eval pass, as its step-1 script does."""
    import shardspeed as deepspeed
    from shardspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from models import TinyGPT, token_batches

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},
    }  # fmt: skip
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=TinyGPT(layers=3), config=config)
    batches = token_batches(3, 2)
    for batch in batches[:2]:
        engine.train()
        engine.backward(engine(batch))
        engine.step()
        engine.eval()
        with torch.no_grad():
            engine(batches[2])

    def z3_params_to_fetch(params):
        return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]

    saved = {}
    for name, v in engine.module.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(z3_params_to_fetch([v]), enabled=True):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        saved[name] = v_p
    reference = engine._zero3_consolidated_16bit_state_dict()  # gathers unit by unit, whatever the status
    differ = [] if reference is None else [n for n, t in saved.items() if not torch.equal(t, reference[n])]
    return {"shapes": {n: tuple(t.shape) for n, t in saved.items()}, "differ": differ}


def test_deepspeed_chat_zero3_save_after_train_and_eval_writes_every_weight(tmp_path):
    for rank, result in enumerate(run_ranks(_deepspeed_chat_save, 2, str(tmp_path))):
        shapes = result["shapes"]
        assert len(shapes) == 34, shapes  # TinyGPT(layers=3): every parameter, the tied head once
        empty = [n for n, shape in shapes.items() if 0 in shape]
        assert not empty, f"rank {rank}: {len(empty)} of {len(shapes)} tensors empty: {empty}"
        assert not result["differ"], (
            f"rank {rank}: differ from the engine's 16-bit export: {result['differ']}"
        )


def _export_of_released_weights() -> str:
    """An export must refuse a ZeRO-3 parameter whose data is empty rather than write it."""
    import shardspeed
    from shardspeed.checkpoint.export import _refuse_partial_weights

    from harness import error_text

    engine, *_ = shardspeed.initialize(
        model=_MLP(), config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    )  # fmt: skip
    released = {n: p.data for n, p in engine.module.named_parameters()}  # empty: every unit is released
    return error_text(lambda: _refuse_partial_weights(engine.module, released))


def test_an_export_refuses_a_released_zero3_parameter():
    for message in run_ranks(_export_of_released_weights, 2):
        assert message.startswith("CheckpointError: refusing to export 6 ZeRO-3 parameter(s)"), message
        assert "layers.0.weight (0,) (full shape (16, 8))" in message, message


def _gathered_parameters_of_foreign_param() -> str:
    import shardspeed

    from harness import error_text

    param = nn.Parameter(torch.empty(0))
    param.ds_id, param.ds_shape = 12345, torch.Size([4, 4])  # marked as ZeRO-3 but owned by nothing here

    def enter():
        with shardspeed.zero.GatheredParameters([param]):
            pass

    return error_text(enter)


def test_gathered_parameters_refuses_to_hand_out_an_empty_zero3_parameter():
    message = run_ranks(_gathered_parameters_of_foreign_param, 1)[0]
    assert message == "RuntimeError: GatheredParameters could not gather 1 parameter(s): ds_id 12345 (4, 4)"


def _empty_cache_mid_run(empty: bool, with_optimizer: bool) -> dict:
    """DeepSpeed's TestZeroPartitionCache: with every parameter persistent, `empty_partition_cache` leaves no
    parameter holding data; the run then goes on as if it had not been called."""
    import shardspeed

    from models import TinyGPT, token_batches

    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10**9}}  # fmt: skip
    if with_optimizer:
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.01}}
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config=config)
    seen, losses = {}, []
    for step, batch in enumerate(token_batches(3, 2)):
        if with_optimizer:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
        else:
            with torch.no_grad():
                loss = engine(batch)
        losses.append(loss.item())
        if step == 0:
            seen["persistent"] = all(p.ds_persist for p in engine.module.parameters())
            seen["numel before"] = sum(p.numel() for p in engine.module.parameters())
            if empty:
                engine.empty_partition_cache()
            seen["numel after"] = sum(p.numel() for p in engine.module.parameters())
            seen["statuses after"] = {p.ds_status.name for p in engine.module.parameters()}
    seen["losses"] = losses
    seen["numel at the end"] = sum(p.numel() for p in engine.module.parameters())
    return seen


@pytest.mark.parametrize("with_optimizer", [True, False], ids=["training", "evaluation"])
def test_empty_partition_cache_releases_persistent_parameters_too(with_optimizer):
    emptied, kept = (run_ranks(_empty_cache_mid_run, 2, empty, with_optimizer)[0] for empty in (True, False))
    total = kept["numel before"]
    assert emptied["persistent"] and total > 0
    assert emptied["numel after"] == 0 and emptied["statuses after"] == {"NOT_AVAILABLE"}, emptied
    assert kept["numel after"] == total  # persistent parameters stay gathered otherwise
    assert emptied["numel at the end"] == total  # gathered again by the next forward, and kept from then on
    assert emptied["losses"] == kept["losses"]
