"""Malformed configs: each is refused with a ConfigError whose message names the offending key path."""

import pytest

from shardspeed.config import ConfigError, load_config

BASE = {"train_micro_batch_size_per_gpu": 2}


def with_base(**extra):
    return {**BASE, **extra}


# (config, key path that must appear in the message, another fragment that must appear)
MALFORMED = [
    (with_base(zero_optimisation={"stage": 2}), "zero_optimisation", "did you mean 'zero_optimization'"),
    (
        with_base(fp16={"enabled": True, "loss_scale_windw": 500}),
        "fp16.loss_scale_windw",
        "fp16.loss_scale_window",
    ),
    (
        with_base(zero_optimization={"stage": 5}),
        "zero_optimization.stage",
        "must be one of 0, 1, 2, 3, got 5",
    ),
    (with_base(zero_optimization={"stage": "2"}), "zero_optimization.stage", '"2"'),
    (with_base(zero_optimization={"stage": True}), "zero_optimization.stage", "true"),
    ({"train_batch_size": True}, "train_batch_size", "got true"),
    ({"train_batch_size": "32"}, "train_batch_size", "without quotes"),
    ({"train_batch_size": 32.5}, "train_batch_size", "32.5"),
    ({"train_batch_size": 0}, "train_batch_size", "must be > 0"),
    ({"train_micro_batch_size_per_gpu": -4}, "train_micro_batch_size_per_gpu", "-4"),
    (with_base(gradient_accumulation_steps=0), "gradient_accumulation_steps", "must be > 0"),
    (with_base(gradient_clipping=-1.0), "gradient_clipping", "must be >= 0"),
    (with_base(gradient_clipping="1.0"), "gradient_clipping", "without quotes"),
    (with_base(fp16={"enabled": "yes"}), "fp16.enabled", "boolean"),
    (with_base(fp16={"enabled": True}, bf16={"enabled": True}), "bf16.enabled", "fp16.enabled"),
    (
        with_base(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
        "zero_optimization.offload_param",
        "stage",
    ),
    (
        with_base(zero_optimization={"stage": 3, "offload_optimizer": {"device": "gpu"}}),
        "zero_optimization.offload_optimizer.device",
        "'none', 'cpu', 'nvme'",
    ),
    (
        with_base(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
        "zero_optimization.offload_param.nvme_path",
        "nvme",
    ),
    (
        with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
        "zero_optimization.offload_optimizer.ratio",
        "stage",
    ),
    (
        with_base(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}),
        "zero_optimization.offload_optimizer.ratio",
        "<= 1",
    ),
    (
        with_base(zero_optimization={"stage": 2, "reduce_bucket_size": 0}),
        "zero_optimization.reduce_bucket_size",
        "must be > 0",
    ),
    (
        with_base(zero_optimization={"stage": 2, "allgather_bucket_size": -5}),
        "zero_optimization.allgather_bucket_size",
        "-5",
    ),
    (
        with_base(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": -1}),
        "zero_optimization.stage3_prefetch_bucket_size",
        ">= 0",
    ),
    (
        with_base(zero_optimization={"stage": 2}, gradient_predivide_factor=2.0),
        "gradient_predivide_factor",
        "reduce_scatter",
    ),
    (
        with_base(zero_optimization={"stage": 1, "legacy_stage1": True}),
        "zero_optimization.legacy_stage1",
        "no longer supported",
    ),
    (
        with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pinmemory": True}}),
        "zero_optimization.offload_optimizer.pinmemory",
        "pin_memory",
    ),
    (
        with_base(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}),
        "optimizer.params.max_grad_norm",
        "gradient_clipping",
    ),
    (with_base(optimizer={"params": {"lr": 1e-3}}), "optimizer.type", "required"),
    (with_base(optimizer={"type": 3, "params": {}}), "optimizer.type", "string"),
    (with_base(optimizer={"type": "Adam", "params": [0.1]}), "optimizer.params", "object"),
    (with_base(optimizer={"type": "Adam", "parms": {}}), "optimizer.parms", "optimizer.params"),
    (with_base(scheduler={"params": {"warmup_num_steps": 10}}), "scheduler.type", "required"),
    (with_base(scheduler={"type": None}), "scheduler.type", "string"),
    (with_base(communication_data_type="fp8"), "communication_data_type", "'fp32', 'fp16', 'bf16'"),
    (with_base(data_types={"grad_accum_dtype": "int8"}), "data_types.grad_accum_dtype", "int8"),
    (
        with_base(checkpoint={"tag_validation": "Sometimes"}),
        "checkpoint.tag_validation",
        "'Ignore', 'Warn', 'Fail'",
    ),
    (
        with_base(checkpoint={"parallel_write": {"pipeline_stage": 2}}),
        "checkpoint.parallel_write.pipeline_stage",
        "boolean",
    ),
    (with_base(steps_per_print="10"), "steps_per_print", "without quotes"),
    (with_base(fp16=True), "fp16", "object"),
    (with_base(comms_logger={"enabled": True, "prof_ops": "all_reduce"}), "comms_logger.prof_ops", "list"),
    (
        with_base(zero_optimization={"leaf_module": {"names": ["a", 4]}}),
        "zero_optimization.leaf_module.names[1]",
        "string",
    ),
    (
        with_base(tensorboard={"enabled": True, "outputpath": "/tmp"}),
        "tensorboard.outputpath",
        "tensorboard.output_path",
    ),
    (with_base(torch_autocast={"enabled": True}, fp16={"enabled": True}), "torch_autocast.enabled", "fp16"),
    (with_base(data_types={"param_dtype": "fp16"}), "data_types.param_dtype", "fp32"),
    (with_base(gradient_allreduce_op="max"), "gradient_allreduce_op", "'mean', 'sum'"),
    (
        with_base(gradient_allreduce_op="sum", zero_optimization={"stage": 3}),
        "gradient_allreduce_op",
        "stage 3",
    ),
    (
        with_base(zero_optimization={"stage": 3, "compute_grad_norm": False}),
        "zero_optimization.compute_grad_norm",
        "stage 1 or 2",
    ),
    (
        with_base(zero_optimization={"stage": 2, "compute_grad_norm": False}),
        "zero_optimization.compute_grad_norm",
        "gradient_clipping",
    ),
    (with_base(log_level="loud"), "log_level", "'DEBUG'"),
    (with_base(torch_autocast={"enabled": True, "dtype": "fp32"}), "torch_autocast.dtype", "lower precision"),
    (
        with_base(zero_optimization={"stage": 2, "cpu_offload": "yes"}),
        "zero_optimization.cpu_offload",
        "boolean",
    ),
    (
        with_base(
            zero_optimization={"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
        ),
        "zero_optimization.cpu_offload",
        "offload_optimizer",
    ),
    (
        with_base(
            zero_optimization={"stage": 3, "prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}
        ),
        "zero_optimization.prefetch_bucket_size",
        "stage3_prefetch_bucket_size",
    ),
    (with_base(bfloat16={"enabled": True}, bf16={"enabled": True}), "bfloat16", "bf16"),
    (with_base(fp16={"enabled": True, "hysteresis": 0}), "fp16.hysteresis", ">= 1"),
    (with_base(fp16={"enabled": True, "loss_scale": -1}), "fp16.loss_scale", ">= 0"),
    (
        with_base(allgather_size=100, zero_optimization={"allgather_bucket_size": 100}),
        "allgather_size",
        "allgather_bucket_size",
    ),
    (
        with_base(activation_checkpointing={"number_checkpoints": 2.5}),
        "activation_checkpointing.number_checkpoints",
        "2.5",
    ),
]


@pytest.mark.parametrize(("config", "key", "fragment"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_config_is_refused_naming_the_key(config, key, fragment):
    with pytest.raises(ConfigError) as caught:
        load_config(config, world_size=1)
    message = str(caught.value)
    assert key in message
    assert fragment in message


def test_there_are_at_least_25_malformed_cases():
    assert len(MALFORMED) >= 25


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config({"train_batch_size": "x"})


def test_unknown_top_level_key_without_close_match():
    with pytest.raises(ConfigError, match="unknown key 'totally_unrelated' at top level"):
        load_config(with_base(totally_unrelated=1))


def test_unknown_nested_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'bf16\.xyz'; valid keys in 'bf16' are: .*enabled"):
        load_config(with_base(bf16={"xyz": 1}))


def test_misspelt_alias_suggests_canonical_name():
    with pytest.raises(ConfigError, match=r"did you mean 'zero_optimization\.stage3_prefetch_bucket_size'"):
        load_config(with_base(zero_optimization={"prefetch_bucket_sise": 10}))


def test_error_names_the_offending_value():
    with pytest.raises(ConfigError) as caught:
        load_config(with_base(zero_optimization={"offload_param": {"device": "disk"}, "stage": 3}))
    assert '"disk"' in str(caught.value)
