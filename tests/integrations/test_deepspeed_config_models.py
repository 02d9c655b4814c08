"""DeepSpeed's pydantic config classes: `DeepSpeedConfigModel` (compat/mirrors/config_model.py) as a base for
other people's configs, and `DeepSpeedFP16Config` / `DeepSpeedBF16Config` (compat/mirrors/precision_config.py)
as views of shardspeed's own fp16/bf16 blocks, with the same fields, defaults and rules.

Needs pydantic (the serve or conformance extra): the integration stage.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

pydantic = pytest.importorskip("pydantic", reason="needs pydantic (the serve or conformance extra)")

from pydantic import Field, ValidationError  # noqa: E402

from shardspeed.config import ConfigError, load_config  # noqa: E402
from shardspeed.config.blocks import Bf16Config, Fp16Config  # noqa: E402
from shardspeed.config.build import ConfigWarning  # noqa: E402
from shardspeed.runtime.config_utils import DeepSpeedConfigModel, get_config_default  # noqa: E402
from shardspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402


class Inner(DeepSpeedConfigModel):
    size: int = 1


class Example(DeepSpeedConfigModel):
    count: int = 0
    old_names: str | None = Field(
        None,
        json_schema_extra={"deprecated": True, "new_param": "names", "new_param_fn": lambda x: x.split(",")},
    )
    names: list[str] | None = None
    old_size: int | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "inner.size"})
    kept: int | None = Field(
        None, json_schema_extra={"deprecated": True, "new_param": "count", "set_new_param": False}
    )
    inner: Inner = Field(default_factory=Inner)
    alias_field: int = Field(0, alias="aliasField")
    dtype: torch.dtype = torch.float16


def test_a_deprecated_field_sets_its_replacement_converted():
    replaced = Example(old_names="a,b")
    assert replaced.names == ["a", "b"]
    assert "old_names" not in replaced.model_dump()  # gone once replaced, as in DeepSpeed
    with pytest.raises(AttributeError):
        replaced.old_names  # noqa: B018
    assert Example(old_size=8).inner.size == 8
    assert Example(kept=5).count == 0  # set_new_param false: only the warning
    with pytest.raises(AssertionError, match="Cannot provide deprecated parameter 'old_names' and replacing"):
        Example(old_names="a", names=["b"])


def test_validation_aliases_unknown_keys_and_assignment():
    assert Example(alias_field=3).alias_field == Example(aliasField=3).alias_field == 3
    for bad in ({"count": "many"}, {"names": "a"}, {"cuont": 1}):
        with pytest.raises(ValidationError):
            Example(**bad)
    example = Example()
    with pytest.raises(ValidationError):
        example.count = "many"
    assert Example().model_dump()["dtype"] == "torch.float16"


def test_auto_is_dropped_with_a_warning_unless_strict():
    with pytest.warns(ConfigWarning, match='"auto" left unfilled, so the default is used for: count'):
        assert Example(count="auto").count == 0
    with pytest.raises(ValidationError), warnings.catch_warnings():
        warnings.simplefilter("error")
        Example(strict=True, count="auto")


def test_get_config_default():
    assert get_config_default(Example, "count") == 0
    assert get_config_default(Example(), "inner") == Inner()
    with pytest.raises(AssertionError, match="'nope' is not a field"):
        get_config_default(Example, "nope")


@pytest.mark.parametrize(
    ("model", "block"), [(DeepSpeedFP16Config, Fp16Config), (DeepSpeedBF16Config, Bf16Config)]
)
def test_the_precision_views_have_the_blocks_fields_and_defaults(model, block):
    defaults = {f.name: f.default for f in dataclasses.fields(block)}
    assert model().model_dump() == defaults


@pytest.mark.parametrize(
    "fp16",
    [
        {"enabled": True, "loss_scale_window": 0},
        {"enabled": True, "min_loss_scale": -1},
        {"enabled": True, "loss_scale": float("inf")},
        {"loss_scale": -2},
        {"hysteresis": 0},
        {"initial_scale_power": -1},
    ],
)
def test_fp16_view_refuses_what_the_block_refuses_with_its_message(fp16):
    with pytest.raises(ConfigError) as ours:
        load_config({"train_batch_size": 1, "fp16": fp16})
    with pytest.raises(ValidationError) as view:
        DeepSpeedFP16Config(**fp16)
    assert str(ours.value) in str(view.value)


def test_fp16_view_accepts_what_the_block_accepts():
    static = DeepSpeedFP16Config(enabled=True, loss_scale=128, loss_scale_window=0)
    assert static.loss_scale_window == 0
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0  # pydantic's own conversion of a string
    config = DeepSpeedFP16Config(enabled=True, initial_scale_power=8, hysteresis=3)
    assert config.initial_dynamic_scale() == 256
    assert config.dynamic_loss_scale_args() == {
        "init_scale": 256,
        "scale_window": 1000,
        "delayed_shift": 3,
        "consecutive_hysteresis": False,
        "min_scale": 1.0,
    }


@pytest.mark.parametrize("value", [True, [], None, "abc"])
def test_fp16_view_refuses_a_non_number_before_pydantic_converts_it(value):
    with pytest.raises(ValidationError, match=r"fp16\.min_loss_scale must be a number"):
        DeepSpeedFP16Config(enabled=True, min_loss_scale=value)


def test_bf16_view():
    assert DeepSpeedBF16Config(enabled=True, immediate_grad_update=True).immediate_grad_update
    with pytest.raises(ValidationError):
        DeepSpeedBF16Config(enabled=True, loss_scale=1)
