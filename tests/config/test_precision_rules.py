"""The fp16 block's loss-scaling rules, and the refusals around `gradient_allreduce_op`, worded as DeepSpeed 0.19
words them where its tests match on the words.

`loss_scale_window` and `min_loss_scale` only steer the dynamic loss scale, so they are checked only when it
is on (fp16 enabled, `loss_scale` 0): a static-scale or disabled block carrying unused values stays valid, as
in DeepSpeed. `loss_scale` itself must be a finite number >= 0 whatever the rest says.
"""

from __future__ import annotations

import pytest

from shardspeed.config import ConfigError, load_config


def _fp16(**block):
    return load_config({"train_batch_size": 1, "fp16": block}).fp16


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale"])
@pytest.mark.parametrize("value", [0, -1])
def test_dynamic_scaling_needs_a_positive_window_and_floor(key, value):
    with pytest.raises(ConfigError, match=rf"fp16\.{key}: must be > 0 under dynamic loss scaling"):
        _fp16(enabled=True, loss_scale=0, **{key: value})


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale"])
def test_unused_window_and_floor_are_not_checked(key):
    static = _fp16(enabled=True, loss_scale=128, **{key: 0})
    assert not static.dynamic_scaling and getattr(static, key) == 0
    disabled = _fp16(enabled=False, **{key: -1})
    assert not disabled.dynamic_scaling and getattr(disabled, key) == -1


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -1.0])
def test_loss_scale_is_a_finite_non_negative_number(value):
    with pytest.raises(ConfigError, match=r"fp16\.loss_scale: must be"):
        _fp16(enabled=True, loss_scale=value)


def test_an_unknown_gradient_allreduce_op_is_refused_in_deepspeeds_words():
    with pytest.raises(
        ConfigError, match=r"Invalid gradient_allreduce_op \"MAX\": must be one of 'mean', 'sum'"
    ):
        load_config({"train_batch_size": 1, "gradient_allreduce_op": "MAX"})
    assert load_config({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"


@pytest.mark.parametrize(
    ("extra", "feature", "key"),
    [
        ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "ZenFlow", "zero_optimization.zenflow"),
        (
            {"zero_optimization": {"stage": 1}, "compile": {"deepcompile": True}},
            "DeepCompile",
            "compile.deepcompile",
        ),
    ],
)
def test_sum_with_an_unimplemented_feature_names_both_reasons(extra, feature, key):
    config = {"train_batch_size": 1, "gradient_allreduce_op": "sum", **extra}
    with pytest.raises(ConfigError, match=f"not supported with {feature}") as error:
        load_config(config)
    assert f"{feature} itself is not implemented by shardspeed; remove {key}" in str(error.value)
    with pytest.raises(ConfigError, match=f"{key}"):  # with "mean" the feature is still refused, by name
        load_config({**config, "gradient_allreduce_op": "mean"})
