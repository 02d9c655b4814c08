"""ZenFlow (`zero_optimization.zenflow`, shardspeed/zero/zenflow/) on 2 CPU ranks with the tiny GPT.

- topk_ratio 1 and update_interval 1: every column is selected, so every step is AdamW on the device: the
  run equals the single-process torch AdamW reference;
- a real ratio: between host updates a step changes exactly the selected columns (and the 1-D parameters);
  at the update interval the other columns take one AdamW step with the mean of the gradients gathered
  since the last update;
- a checkpoint saved in the middle of an update window resumes exactly.
"""

import copy

import pytest
import torch

from common import LR, base_config, build_model, micro_batch, params_of, reference_run, warmup_lr
from harness import run_ranks
from models import token_batches

WORLD = 2


def _config(stage: int, **zenflow) -> dict:
    zero = {
        "stage": stage,
        "reduce_bucket_size": 3000,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": zenflow,
    }
    return base_config(zero_optimization=zero)


def _engine(config: dict):
    import shardspeed

    torch.manual_seed(0)
    model = build_model()
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=copy.deepcopy(config)
    )
    return engine


def _train_steps(engine, data, steps, observe=None) -> None:
    """Optimizer steps `steps` on the global batches `data`; `observe(step)` is called before each step's
    engine.step() of the boundary micro-batch (the averaged gradient is then complete)."""
    import torch.distributed as dist

    rank, micro, gas = (
        dist.get_rank(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )
    for step in steps:
        for m in range(gas):
            engine.backward(engine(micro_batch(data, step, m, rank, WORLD, micro)))
            if m == gas - 1 and observe is not None:
                observe(step)
            engine.step()


# -- topk_ratio 1: plain AdamW ----------------------------------------------------------------------------------


def _all_columns(steps: int) -> dict:
    # No re-selection: it clears the selective moments (as DeepSpeed does), which plain AdamW never does.
    results = {}
    for stage in (1, 2):
        config = _config(
            stage, topk_ratio=1.0, select_strategy="step", select_interval=1000, update_interval=1
        )
        engine = _engine(config)
        _train_steps(engine, token_batches(steps, engine.train_batch_size()), range(steps))
        results[stage] = params_of(engine.module)
    return results


def test_every_column_selected_is_plain_adamw():
    steps = 4
    reference = reference_run(steps, WORLD)
    for results in run_ranks(_all_columns, WORLD, steps):
        for stage, params in results.items():
            assert max((params[k] - reference[k]).abs().max().item() for k in reference) <= 1e-6, stage


# -- a real ratio: the selected columns every step, the rest at the interval ---------------------------------


def _selective_run(steps: int) -> dict:
    from shardspeed.zero import safe_get_full_grad

    config = _config(2, topk_ratio=0.25, select_strategy="step", select_interval=6, update_interval=3)
    config["gradient_clipping"] = 0.0  # the reference below replays the raw averaged gradients
    engine = _engine(config)
    named = dict(engine.module.named_parameters())
    start = params_of(engine.module)
    grads, changed, selections = [], [], []

    def observe(step):
        grads.append({n: safe_get_full_grad(p).clone() for n, p in named.items()})

    data = token_batches(steps, engine.train_batch_size())
    for step in range(steps):
        before = params_of(engine.module)
        _train_steps(engine, data, [step], observe)
        after = params_of(engine.module)
        changed.append({n: (after[n] != before[n]) for n in after})
        selections.append({n: i.clone() for n, i in engine.optimizer.selection.items()})
    return {"start": start, "grads": grads, "changed": changed, "selections": selections,
            "end": params_of(engine.module)}  # fmt: skip


def test_selected_columns_every_step_and_the_rest_at_the_interval():
    steps = 3  # steps 0 and 1 accumulate, step 2 is the first host update
    for result in run_ranks(_selective_run, WORLD, steps):
        selection = result["selections"][0]
        assert all(torch.equal(s[n], selection[n]) for s in result["selections"] for n in selection)
        for step, changed in enumerate(result["changed"]):
            for name, mask in changed.items():
                if name not in selection:  # 1-D: updated whole at every step
                    assert mask.all(), (step, name)
                    continue
                chosen = torch.zeros(mask.shape[1], dtype=torch.bool)
                chosen[selection[name]] = True
                assert mask[:, chosen].any(dim=0).all(), (step, name)  # every selected column moved
                rest = mask[:, ~chosen]
                assert rest.any(dim=0).all() if step == 2 else not rest.any(), (step, name)
        # The unselected columns: one AdamW step from the start with the mean of steps 0-2's gradients.
        for name in selection:
            value = result["start"][name].clone().requires_grad_(True)
            value.grad = sum(g[name] for g in result["grads"]) / steps
            torch.optim.AdamW([value], lr=warmup_lr(2), betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01).step()
            chosen = torch.zeros(value.shape[1], dtype=torch.bool)
            chosen[selection[name]] = True
            diff = (result["end"][name][:, ~chosen] - value.detach()[:, ~chosen]).abs().max().item()
            assert diff <= 1e-6, name
    assert LR > 0


# -- resume in the middle of an update window -------------------------------------------------------------


def _resume(folder: str) -> dict:
    differences = {}
    for stage, offload in ((1, False), (2, True)):
        config = _config(stage, topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=3,
                         full_warm_up_rounds=1, offload=offload)  # fmt: skip
        data = token_batches(7, base_config()["train_micro_batch_size_per_gpu"] * 2 * WORLD)
        straight = _engine(config)
        _train_steps(straight, data, range(3))  # warm-up, then steps 1-2: two gradients pending
        straight.save_checkpoint(f"{folder}/{stage}", tag="mid")
        _train_steps(straight, data, range(3, 7))  # host updates at 3 and 4 (before the re-selection at 5)
        resumed = _engine(config)
        resumed.load_checkpoint(f"{folder}/{stage}", tag="mid")
        _train_steps(resumed, data, range(3, 7))
        a, b = params_of(straight.module), params_of(resumed.module)
        differences[(stage, offload)] = max((a[k] - b[k]).abs().max().item() for k in a)
    # Without this rank's ZenFlow file (another world size, or a checkpoint from a run without ZenFlow) the
    # weights and host optimizer load, and ZenFlow selects afresh at the next step.
    import os

    import torch.distributed as dist

    os.remove(f"{folder}/2/mid/zenflow_rank_{dist.get_rank()}.pt")
    dist.barrier()
    fresh = _engine(config)
    fresh.load_checkpoint(f"{folder}/2", tag="mid")
    selected_before = dict(fresh.optimizer.selection)
    _train_steps(fresh, data, [3])
    differences["afresh"] = (selected_before == {}, sorted(fresh.optimizer.selection) == sorted(resumed.optimizer.selection),
                             fresh.optimizer.schedule.steps - fresh.optimizer.schedule.origin)  # fmt: skip
    return differences


def test_resume_mid_window_continues_exactly(tmp_path):
    for differences in run_ranks(_resume, WORLD, str(tmp_path)):
        assert differences == {(1, False): 0.0, (2, True): 0.0, "afresh": (True, True, 1)}


def _bf16_masters(steps: int) -> dict:
    from shardspeed.zero.zenflow.columns import shard_positions

    config = _config(2, topk_ratio=0.25, select_strategy="step", select_interval=2, update_interval=2)
    config["bf16"] = {"enabled": True}
    engine = _engine(config)
    _train_steps(engine, token_batches(steps, engine.train_batch_size()), range(steps))
    zenflow = engine.optimizer
    checks, positions, moved = [], 0, 0
    for index, (bucket, master) in enumerate(zip(zenflow.buckets, zenflow.masters)):
        where = shard_positions(zenflow.columns, index, bucket, zenflow.selection)
        others = torch.ones(master.numel(), dtype=torch.bool)
        others[where] = False
        old = master.clone()
        positions += where.numel()
        moved += int((old[where] != bucket.shard[where].float()).sum())  # what the device changed since
        zenflow._masters_take_device_columns()
        checks.append(
            {
                "device_columns_taken": torch.equal(master[where], bucket.shard[where].float()),
                "others_kept": torch.equal(master[others], old[others]),
                "master_is_fp32": master.dtype == torch.float32 and bucket.shard.dtype == torch.bfloat16,
            }
        )
    finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
    return {"checks": checks, "positions": positions, "moved": moved, "finite": finite}


def test_bf16_masters_take_only_the_device_columns_at_a_reselection():
    for result in run_ranks(_bf16_masters, WORLD, 5):  # re-selections at steps 2 and 4
        assert result["finite"]
        assert result["positions"] > 0 and result["moved"] > 0  # there was something to take
        for check in result["checks"]:
            assert all(check.values()), check


# -- the config block and the schedule (one process) --------------------------------------------------------


def _zero_block(**zenflow) -> dict:
    return {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}


@pytest.mark.parametrize(
    "config,message",
    [
        ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2, "zenflow": {}}},
         "not supported with ZenFlow"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}},
         "stage 1 or 2, got stage 3"),
        ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "offload_optimizer.device 'cpu'"),
        ({"zero_optimization": _zero_block(overlap_step=True)}, "zenflow.overlap_step: true is not supported"),
        ({"zero_optimization": _zero_block(pt_reserved_cores_perc=0.25)}, "zenflow.pt_reserved_cores_perc"),
        ({"zero_optimization": _zero_block(select_interval=4)}, "cannot be combined with zero_optimization.zenflow.select_strategy 'auto'"),
        ({"zero_optimization": _zero_block(select_strategy="step")}, "needs a number with zero_optimization.zenflow.select_strategy"),
        ({"zero_optimization": _zero_block(update_interval=0)}, "zenflow.update_interval: must be"),
        ({"zero_optimization": _zero_block(topk_ratio=0)}, "zenflow.topk_ratio: must be > 0"),
        ({"zero_optimization": _zero_block(select_strategy="often")}, "zenflow.select_strategy"),
    ],
)  # fmt: skip
def test_config_refusals_name_the_key(config, message):
    from shardspeed.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config({"train_batch_size": 8, **config})


def _sgd_refused() -> str:
    from shardspeed.config import ConfigError

    config = _config(2)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    config["zero_allow_untested_optimizer"] = True
    try:
        _engine(config)
    except ConfigError as err:
        return str(err)
    return "accepted"


def test_non_adam_optimizer_is_refused():
    assert "needs an Adam-family optimizer" in run_ranks(_sgd_refused, 1)[0]


def test_schedule_intervals():
    from shardspeed.config import ConfigError, load_config
    from shardspeed.zero.zenflow import ZenFlowSchedule

    def schedule(loader_steps=None, **zenflow):
        config = load_config({"train_batch_size": 8, "zero_optimization": _zero_block(**zenflow)})
        return ZenFlowSchedule.from_config(config.zero_optimization.zenflow, loader_steps)

    def run(s, steps):
        marks = []
        for _ in range(steps):
            selects, updates = s.selects_now(), s.updates_now() if not s.in_warm_up() else True
            marks.append(("S" if selects else "") + ("U" if updates else "."))
            s.finish_step(updates)
        return " ".join(marks)

    # warm-up 2, re-select every 4 steps after it, update every 2 and before each re-selection
    assert run(schedule(select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=2),
               10) == "U U S. U . U S. U . U"  # fmt: skip
    # "epoch": every select_interval epochs of the loader's length (3 steps), with a flush before each
    assert (
        run(schedule(3, select_strategy="epoch", select_interval=1, update_interval=2), 6) == "S. U U S. U U"
    )
    with pytest.raises(ConfigError, match="more often than"):
        schedule(1, select_strategy="epoch", select_interval=1, update_interval=2)
    assert schedule(select_strategy="auto").select_every == 0  # no loader, no steps_per_epoch: select once
    assert schedule(5, steps_per_epoch=7).select_every == 7  # the config's epoch length wins


def test_auto_update_interval():
    """update_interval "auto": the host update comes when, in at least auto_ratio of the 2-D parameters, the
    unselected columns have gathered per column what a selected column gets per step on average."""
    from shardspeed.zero.zenflow.schedule import AutoUpdate

    for ratio, due_after in ((0.5, 2), (1.0, 4)):
        auto = AutoUpdate(ratio)
        steps = 0
        while not auto.due():
            # parameter "a" catches up after 2 steps (1 + 1 >= 2), "b" after 4 (4 x 1 >= 4)
            auto.observe("a", selected_per_column=2.0, unselected_per_column=1.0)
            auto.observe("b", selected_per_column=4.0, unselected_per_column=1.0)
            auto.end_step()
            steps += 1
        assert steps == due_after, ratio
        auto.reset()
        assert not auto.due()
    config = {"train_batch_size": 8, "zero_optimization": _zero_block(update_interval="auto", auto_ratio=0.5)}
    from shardspeed.config import load_config
    from shardspeed.zero.zenflow import ZenFlowSchedule

    schedule = ZenFlowSchedule.from_config(load_config(config).zero_optimization.zenflow, None)
    assert schedule.update_every is None and schedule.auto.auto_ratio == 0.5


def test_split_affinity():
    from shardspeed.zero.zenflow import split_affinity

    assert split_affinity(list(range(8)), 0.25) == ([2, 3, 4, 5, 6, 7], [0, 1])
    assert split_affinity([10, 11], 0.5) == ([11], [10])
    assert split_affinity([0, 1, 2, 3], 0.0) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert split_affinity([0, 1, 2, 3], 1.0) == ([0, 1, 2, 3], [0, 1, 2, 3])


def test_selective_adamw_updates_only_the_selected_columns():
    from shardspeed.ops.zenflow_adam import ZenFlowSelectiveAdamW

    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(3, 5))
        start = weight.detach().clone()
        opt = ZenFlowSelectiveAdamW([weight], lr=0.1, weight_decay=0.01, offload=offload)
        reference = torch.nn.Parameter(start[:, [1, 4]].clone())
        torch_opt = torch.optim.AdamW([reference], lr=0.1, weight_decay=0.01)
        torch.manual_seed(1)
        for _ in range(3):
            grad = torch.randn(3, 2)
            weight.selected_indices, weight.selected_grad = torch.tensor([1, 4]), grad.clone()
            opt.step()
            reference.grad = grad
            torch_opt.step()
        assert torch.equal(weight.detach()[:, [0, 2, 3]], start[:, [0, 2, 3]])
        assert (weight.detach()[:, [1, 4]] - reference.detach()).abs().max() <= 1e-6
        assert opt.state[weight]["exp_avg"].shape == (3, 2)
        assert (weight.exp_avg_cpu_data is opt.state[weight]["exp_avg"]) if offload else True
        results.append(weight.detach().clone())
    assert torch.equal(results[0], results[1])  # where the moments live does not change the result


def test_cpu_adam_steps_as_the_given_step_number():
    from shardspeed.ops.adam import DeepSpeedCPUAdam
    from shardspeed.ops.zenflow_adam import ZenFlowCPUAdam

    torch.manual_seed(0)
    start, grads = torch.randn(4, 3), [torch.randn(4, 3) for _ in range(2)]
    mine, plain = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    zenflow, reference = ZenFlowCPUAdam([mine], lr=0.1), DeepSpeedCPUAdam([plain], lr=0.1)
    mine.grad, plain.grad = grads[0].clone(), grads[0].clone()
    zenflow.step(step_id=1)
    reference.step()
    assert torch.equal(mine.detach(), plain.detach())
    # The next host step is training step 4 (three selective steps in between): bias correction uses t = 4.
    mine.grad = grads[1].clone()
    zenflow.step(step_id=4)
    assert zenflow.state[mine]["step"].item() == 4
    m = 0.9 * (0.1 * grads[0]) + 0.1 * grads[1]
    v = 0.999 * (0.001 * grads[0] ** 2) + 0.001 * grads[1] ** 2
    expected = plain.detach() - 0.1 * (m / (1 - 0.9**4)) / ((v / (1 - 0.999**4)).sqrt() + 1e-8)
    assert (mine.detach() - expected).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="overlap_step=True"):
        ZenFlowCPUAdam([mine], overlap_step=True)
