"""DeepSpeed's LR schedules against their formulas, written here from the reference text (§2.3), not from
the implementation; plus resume, unwrapping, and config errors."""

from __future__ import annotations

import argparse
import logging
import math

import pytest
import torch

from shardspeed.config.errors import ConfigError
from shardspeed.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    add_tuning_arguments,
    build_lr_scheduler,
    get_config_from_args,
)


def make_optimizer(kind: str = "adam", groups: int = 1, lr: float = 0.1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.5)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999))


def lrs_over(sched, opt, steps: int) -> list[list[float]]:
    """The optimizer's lrs after each of `steps` calls to step()."""
    out = []
    for _ in range(steps):
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
    return out


# --- independent formulas (t = last_batch_iteration) ---------------------------------------------------


def range_test_lr(t, min_lr, step_size, step_rate, staircase):
    i = (t + 1) / step_size
    if staircase:
        i = math.floor(i)
    return min_lr * (1 + step_rate * i)


def one_cycle(t, lo, hi, first, second, decay_lr_rate, decay_step, min_mom, max_mom, decay_mom_rate):
    total = first + second
    ratio = first / total
    if t < total:
        it = t + 1
        x = 1 + it / total - math.floor(1 + it / total)
        s = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * s, max_mom - (max_mom - min_mom) * s
    d = t - total + 1
    lr = lo if decay_step == 0 or decay_lr_rate == 0 else lo / (1 + decay_lr_rate * d / decay_step)
    mom = (
        max_mom if decay_step == 0 or decay_mom_rate == 0 else max_mom * (1 + decay_mom_rate * d / decay_step)
    )
    return lr, mom


def warmup_gamma(t, num_steps, kind):
    w = max(2, num_steps)
    if t >= w:
        return 1.0
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


def warmup_lr(t, lo, hi, num_steps, kind):
    return lo + (hi - lo) * warmup_gamma(t, num_steps, kind)


def warmup_decay_lr(t, lo, hi, num_steps, total, kind):
    w = max(2, num_steps)
    if t < w:
        gamma = warmup_gamma(t, num_steps, kind)
    else:
        gamma = max(0.0, (total - t) / max(1, total - w))
    return lo + (hi - lo) * gamma


def warmup_cosine_lr(t, base, total, wmin, num_steps, cmin, kind):
    w = max(2, num_steps)
    if t < w:
        ratio = wmin + (1 - wmin) * warmup_gamma(t, num_steps, kind)
    else:
        p = min(1.0, (t - w + 1) / (total - w))  # held at the end: see the module docstring
        ratio = max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * p)) / 2)
    return base * ratio


# --- LRRangeTest ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_formula(staircase):
    opt = make_optimizer()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=7, lr_range_test_step_rate=2.5,
                        lr_range_test_staircase=staircase)  # fmt: skip
    assert sched.last_batch_iteration == -1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    for t, (lr,) in enumerate(lrs_over(sched, opt, 40)):
        assert lr == pytest.approx(range_test_lr(t, 0.01, 7, 2.5, staircase), rel=1e-12)
    assert sched.last_batch_iteration == 39


def test_lr_range_test_per_group_min_lr():
    opt = make_optimizer(groups=2)
    sched = LRRangeTest(opt, lr_range_test_min_lr=[0.01, 0.02], lr_range_test_step_size=5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.02])
    for t, lrs in enumerate(lrs_over(sched, opt, 12)):
        assert lrs == pytest.approx([range_test_lr(t, m, 5, 1.0, False) for m in (0.01, 0.02)])


# --- OneCycle ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "second,decay_lr_rate,decay_step,decay_mom_rate",
    [(None, 0.0, 0, 0.0), (6, 0.5, 3, 0.1), (15, 0.2, 0, 0.3), (4, 0.0, 5, 0.05)],
)
def test_one_cycle_lr_and_momentum(second, decay_lr_rate, decay_step, decay_mom_rate):
    opt = make_optimizer()
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=decay_lr_rate,
                     cycle_first_step_size=10, cycle_second_step_size=second, decay_step_size=decay_step,
                     cycle_min_mom=0.8, cycle_max_mom=0.95, decay_mom_rate=decay_mom_rate)  # fmt: skip
    # Construction: lr = min, beta1 = min momentum, the group's own beta2 kept.
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.8, 0.999))
    second_size = 10 if second is None else second
    for t in range(60):
        sched.step()
        lr, mom = one_cycle(
            t, 0.01, 0.1, 10, second_size, decay_lr_rate, decay_step, 0.8, 0.95, decay_mom_rate
        )
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12), t
        assert opt.param_groups[0]["betas"][0] == pytest.approx(mom, rel=1e-12), t
        assert opt.param_groups[0]["betas"][1] == 0.999
        assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_one_cycle_cycles_sgd_momentum():
    opt = make_optimizer("sgd")
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4)
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.8)
    for t in range(12):
        sched.step()
        lr, mom = one_cycle(t, 0.1, 1.0, 4, 4, 0.0, 0, 0.8, 0.9, 0.0)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr)
        assert opt.param_groups[0]["momentum"] == pytest.approx(mom)


def test_one_cycle_without_momentum_warns(caplog):
    opt = make_optimizer("adagrad")
    caplog.set_level(logging.WARNING, logger="shardspeed")
    logging.getLogger("shardspeed").propagate = True
    try:
        sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4)
    finally:
        logging.getLogger("shardspeed").propagate = False
    assert not sched.cycle_momentum and sched.get_mom() is None
    assert "cycle_momentum is disabled" in caplog.text
    sched.step()
    assert "momentum" not in opt.param_groups[0] and "betas" not in opt.param_groups[0]


# --- WarmupLR / WarmupDecayLR / WarmupCosineLR -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("num_steps", [0, 1, 2, 10])
def test_warmup_lr(kind, num_steps):
    opt = make_optimizer()
    sched = WarmupLR(
        opt, warmup_min_lr=0.001, warmup_max_lr=0.05, warmup_num_steps=num_steps, warmup_type=kind
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001)
    for t, (lr,) in enumerate(lrs_over(sched, opt, 25)):
        assert lr == pytest.approx(warmup_lr(t, 0.001, 0.05, num_steps, kind), rel=1e-12)


def test_warmup_lr_per_group_lists():
    opt = make_optimizer(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.2], warmup_num_steps=5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0, 0.01])
    for t, lrs in enumerate(lrs_over(sched, opt, 10)):
        assert lrs == pytest.approx([warmup_lr(t, 0.0, 0.1, 5, "log"), warmup_lr(t, 0.01, 0.2, 5, "log")])


def test_warmup_unknown_type_warns_and_uses_log(caplog):
    logging.getLogger("shardspeed").propagate = True
    caplog.set_level(logging.WARNING, logger="shardspeed")
    try:
        sched = WarmupLR(make_optimizer(), warmup_max_lr=0.001, warmup_num_steps=8, warmup_type="cosine")
    finally:
        logging.getLogger("shardspeed").propagate = False
    assert "warmup_type" in caplog.text and sched.warmup_type == "log"
    sched.step(4)
    assert sched.get_last_lr()[0] == pytest.approx(warmup_lr(4, 0.0, 0.001, 8, "log"))


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("num_steps,total", [(10, 30), (1, 5), (4, 4), (20, 10)])
def test_warmup_decay_lr(kind, num_steps, total):
    opt = make_optimizer()
    sched = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=0.0, warmup_max_lr=0.02,
                          warmup_num_steps=num_steps, warmup_type=kind)  # fmt: skip
    assert opt.param_groups[0]["lr"] == 0.0
    for t, (lr,) in enumerate(lrs_over(sched, opt, total + 10)):
        assert lr == pytest.approx(
            warmup_decay_lr(t, 0.0, 0.02, num_steps, total, kind), rel=1e-12, abs=1e-15
        )


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("wmin,cmin", [(0.0, 0.0001), (0.1, 0.05)])
def test_warmup_cosine_lr(kind, wmin, cmin):
    opt = make_optimizer(groups=2)
    opt.param_groups[1]["lr"] = 0.3
    sched = WarmupCosineLR(opt, total_num_steps=40, warmup_min_ratio=wmin, warmup_num_steps=8,
                           cos_min_ratio=cmin, warmup_type=kind)  # fmt: skip
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * wmin, 0.3 * wmin])
    for t, lrs in enumerate(lrs_over(sched, opt, 60)):
        expected = [warmup_cosine_lr(t, base, 40, wmin, 8, cmin, kind) for base in (0.1, 0.3)]
        assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15), t
    assert sched.get_last_lr() == pytest.approx([0.1 * cmin, 0.3 * cmin])


# --- counters, resume, wrappers --------------------------------------------------------------------------

SCHEDULES = {
    "LRRangeTest": (LRRangeTest, {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
    "OneCycle": (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                            "decay_step_size": 2, "decay_lr_rate": 0.3, "decay_mom_rate": 0.1}),
    "WarmupLR": (WarmupLR, {"warmup_num_steps": 6, "warmup_type": "linear"}),
    "WarmupDecayLR": (WarmupDecayLR, {"total_num_steps": 20, "warmup_num_steps": 6}),
    "WarmupCosineLR": (WarmupCosineLR, {"total_num_steps": 20, "warmup_num_steps": 6, "warmup_min_ratio": 0.1}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_state_dict_round_trip_continues_identically(name):
    cls, params = SCHEDULES[name]
    opt = make_optimizer(groups=2)
    sched = cls(opt, **params)
    lrs_over(sched, opt, 9)
    state = sched.state_dict()
    assert state["last_batch_iteration"] == 8
    uninterrupted = lrs_over(sched, opt, 20)
    moments = [g.get("betas") for g in opt.param_groups]

    # A fresh run (optimizer lrs back at the configured values), resumed from the saved state.
    opt2 = make_optimizer(groups=2)
    resumed = cls(opt2, **params)
    resumed.load_state_dict(state)
    assert resumed.last_batch_iteration == 8
    assert lrs_over(resumed, opt2, 20) == uninterrupted
    assert [g.get("betas") for g in opt2.param_groups] == moments


def test_cosine_resume_after_optimizer_state_was_loaded_first():
    """The base lrs travel in the state dict, so building the schedule over an optimizer whose lr was
    already restored mid-schedule still resumes exactly."""
    opt = make_optimizer()
    sched = WarmupCosineLR(opt, total_num_steps=30, warmup_num_steps=5)
    lrs_over(sched, opt, 12)
    state, opt_state = sched.state_dict(), opt.state_dict()
    expected = lrs_over(sched, opt, 5)
    opt2 = make_optimizer()
    opt2.load_state_dict(opt_state)
    resumed = WarmupCosineLR(opt2, total_num_steps=30, warmup_num_steps=5)
    resumed.load_state_dict(state)
    assert lrs_over(resumed, opt2, 5) == expected


def test_deepspeed_state_dict_without_extras_loads():
    opt = make_optimizer()
    sched = WarmupCosineLR(opt, total_num_steps=30, warmup_num_steps=5)
    sched.load_state_dict({"last_batch_iteration": 10})
    assert sched.get_last_lr()[0] == pytest.approx(warmup_cosine_lr(10, 0.1, 30, 0.0, 5, 0.0001, "log"))


def test_step_to_explicit_iteration_and_deepspeed_keyword():
    opt = make_optimizer()
    sched = WarmupLR(opt, warmup_max_lr=0.001, warmup_num_steps=10)
    sched.step(7)
    assert sched.last_batch_iteration == 7
    assert opt.param_groups[0]["lr"] == pytest.approx(warmup_lr(7, 0.0, 0.001, 10, "log"))
    sched.step()
    assert sched.last_batch_iteration == 8
    one_cycle_sched = OneCycle(make_optimizer(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4)
    one_cycle_sched.step(batch_iteration=3)
    assert one_cycle_sched.last_batch_iteration == 3


def test_construction_at_a_later_iteration():
    opt = make_optimizer()
    sched = WarmupLR(opt, warmup_max_lr=0.001, warmup_num_steps=10, last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(warmup_lr(4, 0.0, 0.001, 10, "log"))
    sched.step()
    assert sched.last_batch_iteration == 5


def test_unwraps_an_optimizer_wrapper():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = make_optimizer()
    sched = WarmupLR(Wrapper(opt), warmup_max_lr=0.001, warmup_num_steps=4)
    assert sched.optimizer is opt
    sched.step(3)
    assert opt.param_groups[0]["lr"] == pytest.approx(warmup_lr(3, 0.0, 0.001, 4, "log"))
    torch_sched = build_lr_scheduler("StepLR", {"step_size": 2}, Wrapper(opt))
    assert torch_sched.optimizer is opt


# --- build_lr_scheduler ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["WarmupLR", "warmuplr", "WARMUPLR"])
def test_build_deepspeed_names_case_insensitive(name):
    assert type(build_lr_scheduler(name, {"warmup_num_steps": 5}, make_optimizer())) is WarmupLR


def test_build_torch_schedule_by_name():
    opt = make_optimizer()
    sched = build_lr_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert isinstance(build_lr_scheduler("cosineannealinglr", {"T_max": 10}, opt),
                      torch.optim.lr_scheduler.CosineAnnealingLR)  # fmt: skip


@pytest.mark.parametrize(
    "type_name,params,key",
    [
        ("WarmupLRR", {}, "scheduler.type"),
        (None, {}, "scheduler.type"),
        ("WarmupLR", {"warmup_num_step": 10}, "scheduler.params.warmup_num_step"),
        ("WarmupLR", {"warmup_num_steps": -1}, "scheduler.params.warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, "scheduler.params.warmup_num_steps"),
        ("WarmupLR", {"warmup_max_lr": "auto"}, "scheduler.params.warmup_max_lr"),
        ("WarmupLR", {"warmup_min_lr": [0.0, 0.1]}, "scheduler.params.warmup_min_lr"),
        ("WarmupDecayLR", {}, "scheduler.params.total_num_steps"),
        ("WarmupCosineLR", {"total_num_steps": 0}, "scheduler.params.total_num_steps"),
        ("OneCycle", {"cycle_min_lr": 0.1}, "scheduler.params.cycle_max_lr"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0},
         "scheduler.params.cycle_first_step_size"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size"),
        ("StepLR", {}, "scheduler.params.step_size"),
        ("StepLR", {"step_size": 2, "gama": 0.5}, "scheduler.params.gama"),
        ("WarmupLR", "not a dict", "scheduler.params"),
    ],
)  # fmt: skip
def test_build_errors_name_the_key(type_name, params, key):
    with pytest.raises(ConfigError) as info:
        build_lr_scheduler(type_name, params, make_optimizer())
    assert key in str(info.value)


def test_unknown_name_suggests():
    with pytest.raises(ConfigError, match="did you mean 'WarmupDecayLR'"):
        build_lr_scheduler("WarmupDecay", {}, make_optimizer())
    with pytest.raises(ConfigError, match="did you mean 'warmup_num_steps'"):
        build_lr_scheduler("WarmupLR", {"warmup_num_step": 3}, make_optimizer())


# --- CLI flags ---------------------------------------------------------------------------------------------


def test_tuning_arguments_to_config():
    parser = add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--lr_schedule", "WarmupLR", "--warmup_num_steps", "50", "--warmup_max_lr", "0.01"]
    )
    config, error = get_config_from_args(args)
    assert error is None
    assert config == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 50, "warmup_type": "log"},
    }
    sched = build_lr_scheduler(config["type"], config["params"], make_optimizer())
    assert isinstance(sched, WarmupLR)

    args = parser.parse_args(["--lr_schedule", "OneCycle", "--cycle_first_step_size", "10"])
    config, error = get_config_from_args(args)
    assert error is None and "cycle_second_step_size" not in config["params"]
    assert isinstance(build_lr_scheduler(config["type"], config["params"], make_optimizer()), OneCycle)

    args = parser.parse_args(["--lr_range_test_staircase", "true"])
    assert args.lr_range_test_staircase is True
    assert get_config_from_args(args) == (None, "--lr_schedule not specified on command line")


def test_warmup_max_lr_defaults_to_each_groups_lr():
    """DeepSpeed 0.19: without warmup_max_lr every group warms up to its own lr."""
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    sched = WarmupLR(opt, warmup_num_steps=10)
    assert sched.max_lrs == [0.1, 0.2]
    sched.step(10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])


def test_a_tensor_lr_is_filled_in_place():
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.05)
    assert sched.get_last_lr() == [pytest.approx(0.05)] and isinstance(sched.get_last_lr()[0], float)


def test_one_cycle_stairs_per_group_momenta_and_zero_second_half():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.001, betas=(0.9, 0.99))
    continuous = OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=8)
    stairs = OneCycle(make_optimizer(), cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=8,
                      cycle_first_stair_count=2)  # fmt: skip
    smooth, stepped = [], []
    for _ in range(8):
        continuous.step()
        stairs.step()
        smooth.append(continuous.get_lr()[0])
        stepped.append(stairs.get_lr()[0])
    assert len(set(smooth)) == 8 and len(set(stepped)) == 3  # two stairs up, then the peak
    assert stepped[0] == stepped[1] and stepped[7] == pytest.approx(0.01)
    assert continuous.get_mom()[0] == (pytest.approx(0.8), 0.99)  # (beta1, beta2) at the peak, as DeepSpeed
    two = torch.optim.Adam(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}]
    )
    per_group = OneCycle(two, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=5,
                         cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95])  # fmt: skip
    assert [g["betas"][0] for g in two.param_groups] == pytest.approx([0.8, 0.85])
    flat = OneCycle(make_optimizer(), cycle_min_lr=0.001, cycle_max_lr=0.1, cycle_first_step_size=100,
                    cycle_second_step_size=0)  # fmt: skip
    assert flat.step_ratio == 1.0
    with pytest.raises(ConfigError, match="cycle_max_mom"):
        OneCycle(two, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_max_mom=[0.9, 0.95, 0.99])
    del per_group
