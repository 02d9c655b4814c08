"""The dynamic loss scaler follows DeepSpeed's state machine."""

import pytest

from shardspeed.core.precision import LossScaler


def test_hysteresis_delays_the_first_decrease():
    scaler = LossScaler(init_scale=1024, scale_window=1000, hysteresis=2)
    scaler.update(True)
    assert scaler.loss_scale == 1024  # first overflow only spends hysteresis
    scaler.update(True)
    assert scaler.loss_scale == 512


def test_scale_grows_after_a_clean_window():
    scaler = LossScaler(init_scale=8, scale_window=3, hysteresis=1)
    scaler.update(True)  # iter 0 overflow -> 4
    assert scaler.loss_scale == 4
    for _ in range(2):
        scaler.update(False)
    assert scaler.loss_scale == 4
    scaler.update(False)  # (3 - 0) % 3 == 0 -> doubles
    assert scaler.loss_scale == 8


def test_hysteresis_is_restored_by_growth_or_consecutive_mode():
    scaler = LossScaler(init_scale=64, scale_window=2, hysteresis=2, consecutive_hysteresis=True)
    scaler.update(True)
    assert scaler.cur_hysteresis == 1
    scaler.update(False)
    assert scaler.cur_hysteresis == 2  # consecutive: any clean step restores it


def test_minimum_scale_raises_with_advice():
    scaler = LossScaler(init_scale=2, hysteresis=1, min_scale=1)
    scaler.update(True)
    assert scaler.loss_scale == 1
    with pytest.raises(FloatingPointError, match="bf16"):
        scaler.update(True)


def test_static_scale_never_changes_and_state_round_trips():
    static = LossScaler(init_scale=128, dynamic=False)
    static.update(True)
    assert static.loss_scale == 128
    dynamic = LossScaler(init_scale=32, scale_window=2, hysteresis=1)
    dynamic.update(True)
    dynamic.update(False)
    copy = LossScaler(init_scale=1, scale_window=2, hysteresis=1)  # hyper-parameters come from config
    copy.load_state_dict(dynamic.state_dict())
    for overflow in (False, False, True, False):
        dynamic.update(overflow)
        copy.update(overflow)
        assert copy.loss_scale == dynamic.loss_scale
