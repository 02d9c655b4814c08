"""Dotted top-level keys (`"zero_optimization.reduce_bucket_size": 4096`) are read as the nested key they
name, as TRL's `prepare_deepspeed` writes the reference model's ZeRO-3 sizes; one that names nothing is
refused with its dotted spelling."""

import copy
import logging
import re

import pytest

from shardspeed.config import ConfigError, load_config

HIDDEN = 64
ZERO3 = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": 500_000_000}}


def trl_reference_config(base: dict) -> dict:
    """What TRL 1.16's prepare_deepspeed hands deepspeed.initialize for a ZeRO-3 reference model."""
    config = copy.deepcopy(base)
    config.update(
        {
            "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
            "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
            "zero_optimization.stage3_prefetch_bucket_size": 0.9 * HIDDEN * HIDDEN,
        }
    )
    return config


def test_trl_reference_config_sets_the_nested_keys(caplog):
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        cfg = load_config(trl_reference_config(ZERO3), world_size=2)
    zero = cfg.zero_optimization
    assert zero.stage == 3
    assert zero.reduce_bucket_size == HIDDEN * HIDDEN  # the dotted key wins over the nested 5e8
    assert zero.stage3_param_persistence_threshold == 10 * HIDDEN
    # 0.9 * 64 * 64 = 3686.4 elements: an element count, rounded down (as HF's own "auto" fill does)
    assert zero.stage3_prefetch_bucket_size == 3686
    lines = [r.getMessage() for r in caplog.records if "dotted" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "zero_optimization.reduce_bucket_size" in lines[0] and "500000000" in lines[0]
    assert "3686.4" in lines[0] and "rounded down" in lines[0]
    # raw holds the nested form: whoever reads it (checkpoints' ds_config, re-resolution) sees one spelling
    assert "zero_optimization.reduce_bucket_size" not in cfg.raw
    assert cfg.raw["zero_optimization"]["stage3_prefetch_bucket_size"] == 3686
    assert load_config(cfg, world_size=1).zero_optimization.reduce_bucket_size == HIDDEN * HIDDEN


def test_the_callers_dict_is_not_modified():
    config = trl_reference_config(ZERO3)
    before = copy.deepcopy(config)
    load_config(config, world_size=2)
    assert config == before


def test_a_dotted_key_creates_its_block_and_reaches_free_form_objects():
    cfg = load_config(
        {
            "train_batch_size": 4,
            "bf16.enabled": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "optimizer.params.weight_decay": 0.1,
            "zero_optimization.offload_optimizer.device": "cpu",
            "zero_optimization.stage": 2,
        }
    )
    assert cfg.bf16.enabled and cfg.zero_optimization.stage == 2
    assert cfg.optimizer.params == {"lr": 1e-3, "weight_decay": 0.1}
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_a_dotted_synonym_replaces_the_nested_spelling():
    # `prefetch_bucket_size` is DeepSpeed's short name of stage3_prefetch_bucket_size: one field, one value
    cfg = load_config(
        {
            "train_batch_size": 4,
            "zero_optimization": {"stage": 3, "prefetch_bucket_size": 1000},
            "zero_optimization.stage3_prefetch_bucket_size": 2000,
        }
    )
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 2000


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("zero_optimization.reduce_bucket_sise", "'zero_optimization.reduce_bucket_sise'"),
        ("zero_optimisation.stage", "'zero_optimisation.stage'"),
        ("no_such_block.enabled", "'no_such_block.enabled'"),
        ("fp16.enabled.deeper", "'fp16.enabled.deeper'"),
        ("zero_optimization.", "'zero_optimization.'"),
    ],
)
def test_a_dotted_key_that_names_nothing_is_refused_by_its_dotted_spelling(key, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"train_batch_size": 4, key: 1})


def test_a_misspelt_dotted_key_gets_the_closest_valid_name():
    with pytest.raises(ConfigError, match=r"did you mean 'zero_optimization.reduce_bucket_size'"):
        load_config({"train_batch_size": 4, "zero_optimization.reduce_bucket_sise": 4096})


def test_two_dotted_keys_for_one_field_are_refused():
    with pytest.raises(ConfigError, match=r"prefetch_bucket_size.*given twice"):
        load_config(
            {
                "train_batch_size": 4,
                "zero_optimization.prefetch_bucket_size": 10,
                "zero_optimization.stage3_prefetch_bucket_size": 20,
            }
        )


def test_a_dotted_key_into_a_value_that_is_not_a_block_is_refused():
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage'.*zero_optimization"):
        load_config({"train_batch_size": 4, "zero_optimization": 3, "zero_optimization.stage": 2})


def test_fractions_stay_errors_where_no_dotted_key_wrote_them():
    # Only a dotted key's fraction is rounded (TRL computes 0.9 * h * h there); written nested, 2.5
    # elements is the user's mistake and is refused as before.
    with pytest.raises(ConfigError, match=r"stage3_prefetch_bucket_size: expected an integer, got 2.5"):
        load_config(
            {"train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 2.5}}
        )
    # A dotted fraction for a field that is not a count is passed through unchanged (and checked as usual).
    cfg = load_config({"train_batch_size": 4, "gradient_clipping": 1.0, "fp16.loss_scale_window": 10})
    assert cfg.fp16.loss_scale_window == 10
    with pytest.raises(ConfigError, match=r"fp16.enabled"):
        load_config({"train_batch_size": 4, "fp16.enabled": 0.5})


def test_auto_through_a_dotted_key_is_handled_as_nested_auto():
    with pytest.warns(UserWarning, match=r"zero_optimization.reduce_bucket_size"):
        cfg = load_config({"train_batch_size": 4, "zero_optimization.reduce_bucket_size": "auto"})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


def test_zero_init_reads_a_dotted_precision_key_as_the_engine_does():
    import torch

    from shardspeed.zero.init import _dtype_from_config  # zero.Init reads only the precision blocks

    assert _dtype_from_config({"bf16.enabled": True}) is torch.bfloat16
    assert _dtype_from_config({"fp16": {"enabled": False}, "fp16.enabled": True}) is torch.float16
    assert _dtype_from_config({"bf16": {"enabled": True}, "bf16.enabled": False}) is None
