"""The batch triple: DeepSpeed's inference table (reference §2.1) and errors that show the arithmetic."""

import pytest

from shardspeed.config import ConfigError, load_config, resolve_batch_sizes

# (train, micro, gas, world) -> (train, micro, gas)
INFERENCE_TABLE = [
    ((32, 4, 2, 4), (32, 4, 2)),  # all three given: nothing derived
    ((32, 4, None, 2), (32, 4, 4)),  # train + micro: gas = train // micro // world
    ((32, None, 2, 2), (32, 8, 2)),  # train + gas: micro = train // world // gas
    ((None, 4, 2, 2), (16, 4, 2)),  # micro + gas: train = micro * gas * world
    ((32, None, None, 4), (32, 8, 1)),  # train only: gas = 1, micro = train // world
    ((None, 4, None, 3), (12, 4, 1)),  # micro only: gas = 1, train = micro * world
    ((8, 8, None, 1), (8, 8, 1)),
    ((64, None, None, 1), (64, 64, 1)),
]


@pytest.mark.parametrize(("given", "expected"), INFERENCE_TABLE)
def test_inference_table(given, expected):
    assert resolve_batch_sizes(*given) == expected


@pytest.mark.parametrize(("given", "expected"), INFERENCE_TABLE)
def test_inference_table_through_load_config(given, expected):
    train, micro, gas, world = given
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    config = {key: value for key, value in zip(keys, (train, micro, gas)) if value is not None}
    cfg = load_config(config, world_size=world)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected
    assert cfg.world_size == world


def test_mismatch_shows_the_arithmetic_with_key_names():
    with pytest.raises(ConfigError) as caught:
        resolve_batch_sizes(32, 4, 2, 2)
    message = str(caught.value)
    assert (
        "train_batch_size (32) != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (2) "
        "* world size (2) = 16" in message
    )
    assert "Hint" in message


def test_non_divisible_train_batch_marks_the_derived_value():
    # DeepSpeed floors 30 // 4 // 2 = 3, then fails the product check 4 * 3 * 2 = 24 != 30.
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps \(3, derived\)"):
        resolve_batch_sizes(30, 4, None, 2)


def test_derived_zero_is_explained():
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps: derived as train_batch_size \(2\)"):
        resolve_batch_sizes(2, 4, None, 2)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu: derived as"):
        resolve_batch_sizes(2, None, 4, 1)


@pytest.mark.parametrize("gas", [None, 4])
def test_neither_train_nor_micro_names_both_keys(gas):
    with pytest.raises(ConfigError) as caught:
        resolve_batch_sizes(None, None, gas, 1)
    assert "train_batch_size" in str(caught.value)
    assert "train_micro_batch_size_per_gpu" in str(caught.value)


def test_empty_config_names_both_keys():
    with pytest.raises(ConfigError, match="train_batch_size and train_micro_batch_size_per_gpu"):
        load_config({})


@pytest.mark.parametrize(
    ("args", "key"),
    [
        ((0, None, None, 1), "train_batch_size"),
        ((None, -1, None, 1), "train_micro_batch_size_per_gpu"),
        ((8, 8, 0, 1), "gradient_accumulation_steps"),
        ((8, None, None, 0), "world size"),
        ((True, None, None, 1), "train_batch_size"),
    ],
)
def test_non_positive_values_are_refused(args, key):
    with pytest.raises(ConfigError, match=key):
        resolve_batch_sizes(*args)


def test_world_size_changes_derivation():
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}
    assert load_config(config, world_size=1).gradient_accumulation_steps == 16
    assert load_config(config, world_size=4).gradient_accumulation_steps == 4
    assert load_config(config, world_size=16).gradient_accumulation_steps == 1
