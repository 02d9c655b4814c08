"""DeepSpeed's small config helpers that need no pydantic (compat/mirrors/config_utils.py), and stand-ins for
DeepSpeed's exception classes (compat/not_offered.py).

The helpers give DeepSpeed's results: a duplicate key in a JSON object is a ValueError naming it, `pp_int`
prints with thousands separators, `ScientificNotationEncoder` writes large numbers as `5.000000e+08` and
booleans as JSON's. A stand-in for an exception class (`deepspeed.elasticity.config.ElasticityError`) is an
exception class, so `pytest.raises` / `except` naming it stay valid, and nothing raises it.
"""

from __future__ import annotations

import json

import pytest

import shardspeed
from shardspeed.compat.not_offered import NotOfferedError
from shardspeed.runtime import config_utils


def test_duplicate_keys_are_refused_naming_them():
    text = '{"train_batch_size": 24, "fp16": {}, "train_batch_size": 24}'
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['train_batch_size'\]"):
        json.loads(text, object_pairs_hook=config_utils.dict_raise_error_on_duplicate_keys)
    assert json.loads('{"a": 1}', object_pairs_hook=config_utils.dict_raise_error_on_duplicate_keys) == {
        "a": 1
    }


def test_getters_take_the_value_or_the_default():
    assert config_utils.get_scalar_param({"a": 0}, "a", 5) == 0
    assert config_utils.get_list_param({}, "b", [1]) == [1]
    assert config_utils.get_dict_param({"c": {}}, "c", None) == {}


def test_pp_int_prints_with_separators_or_its_own_text():
    assert repr(config_utils.pp_int(1e5)) == "100,000"
    assert repr(config_utils.pp_int(5, "five")) == "five"
    assert config_utils.pp_int(1e5) == 100000


def test_scientific_notation_encoder_writes_deepspeeds_text():
    config = {"reduce_bucket_size": 5e8, "overlap_comm": True, "stage": 2, "sizes": [1, 2000]}
    text = json.dumps(config, indent=4, cls=config_utils.ScientificNotationEncoder)
    assert text == (
        '{\n    "reduce_bucket_size": 5.000000e+08, \n    "overlap_comm": true, \n    "stage": 2, '
        '\n    "sizes": [1, 2.000000e+03]\n}'
    )

    class Holder(config_utils.DeepSpeedConfigObject):
        def __init__(self):
            self.b, self.a = 3e9, False

    # the encoder writes objects in insertion order (DeepSpeed's does too, sort_keys notwithstanding)
    assert repr(Holder()) == '{\n    "b": 3.000000e+09, \n    "a": false\n}'


def test_a_stand_in_exception_class_is_an_exception_class_never_raised():
    elasticity_error = shardspeed.elasticity.config.ElasticityError
    assert issubclass(elasticity_error, Exception)
    with pytest.raises(NotOfferedError, match=r"elastic training was removed in DeepSpeed 0\.19"):
        try:
            shardspeed.elasticity.compute_elastic_config(ds_config={}, target_deepspeed_version="0.19.8")
        except elasticity_error:  # a valid except clause that nothing matches
            pytest.fail("a stand-in exception class was raised")
    with pytest.raises(NotOfferedError):
        elasticity_error("constructing it says it is not offered")
    assert issubclass(shardspeed.elasticity.config.ElasticityIncompatibleWorldSize, Exception)
    assert not issubclass(shardspeed.elasticity.config.ElasticityConfig, BaseException)
