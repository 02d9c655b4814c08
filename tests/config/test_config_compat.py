"""DeepSpeed compatibility: defaults, deprecated forms, "auto", refused keys, real configs."""

import sys
import warnings

import pytest

from shardspeed.config import IMPLEMENTED, ConfigError, ConfigWarning, load_config
from shardspeed.config.loader import parse_config_text
from shardspeed.config.zero import ZeroConfig

BASE = {"train_micro_batch_size_per_gpu": 2}


def load_recording(config, world_size=1):
    """Load and return (cfg, list of ConfigWarning messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, world_size=world_size)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# A ZeRO-3 + CPU offload + fp16 + WarmupDecayLR config as DeepSpeed users write it (DeepSpeed docs / HF
# examples style, with every "auto" already filled in).
REALISTIC_ZERO3 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "steps_per_print": 100,
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
    "prescale_gradients": False,
    "fp16": {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 500,
            "total_num_steps": 10000,
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 16777216,
        "stage3_prefetch_bucket_size": 15099494,
        "stage3_param_persistence_threshold": 40960,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "zero_allow_untested_optimizer": True,
    "checkpoint": {"tag_validation": "fail"},
    "data_types": {"grad_accum_dtype": "fp32"},
    "communication_data_type": "fp16",
}


def test_realistic_zero3_config_loads_cleanly():
    cfg, messages = load_recording(REALISTIC_ZERO3, world_size=2)
    # Every key of it is implemented, parameter offload included: no message.
    assert messages == []
    zero = cfg.zero_optimization
    assert cfg.zero_enabled and zero.stage == 3
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.ratio == 1.0
    assert zero.sub_group_size == 1_000_000_000 and isinstance(zero.sub_group_size, int)
    assert zero.stage3_prefetch_bucket_size == 15099494
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.fp16.enabled and cfg.fp16.initial_scale_power == 16 and cfg.fp16.min_loss_scale == 1.0
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params["lr"] == 3e-4
    assert cfg.scheduler.type == "WarmupDecayLR" and cfg.scheduler.params["total_num_steps"] == 10000
    assert cfg.checkpoint.tag_validation == "Fail"
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 100
    assert cfg.data_types.grad_accum_dtype == "fp32" and cfg.communication_data_type == "fp16"
    assert cfg.raw == REALISTIC_ZERO3


def test_fractional_element_count_is_refused_naming_the_key():
    # An element count of 15099494.4 (e.g. 0.9 * hidden**2 computed by hand) is not silently truncated.
    zero = {**REALISTIC_ZERO3["zero_optimization"], "stage3_prefetch_bucket_size": 15099494.4}
    with pytest.raises(
        ConfigError, match=r"zero_optimization\.stage3_prefetch_bucket_size: expected an integer"
    ):
        load_config({**REALISTIC_ZERO3, "zero_optimization": zero}, world_size=2)


def test_defaults_are_deepspeed_code_defaults():
    cfg, messages = load_recording(BASE)
    assert messages == []
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19.8 clips at 1.0 unless told otherwise
    assert cfg.steps_per_print is None
    assert cfg.gradient_predivide_factor == 1.0 and cfg.prescale_gradients is False
    assert cfg.communication_data_type is None
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.zero_force_ds_cpu_optimizer is True and cfg.zero_allow_untested_optimizer is False
    assert cfg.checkpoint.tag_validation == "Warn"
    zero = cfg.zero_optimization
    assert zero.stage == 0 and not cfg.zero_enabled
    assert zero.overlap_comm is True  # None resolves to on (DeepSpeed: stage == 3); see docs/compatibility.md
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.sub_group_size == 1_000_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.offload_param is None and zero.offload_optimizer is None
    assert (
        cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    )
    assert cfg.bf16.enabled is False and cfg.bf16.immediate_grad_update is False
    assert cfg.bf16.check_grad_overflow is True  # DeepSpeed 0.19: bf16 skips steps with inf/nan gradients
    assert cfg.aio.intra_op_parallelism == 1 and cfg.autotuning.tuner_type == "gridsearch"
    assert cfg.gradient_allreduce_op == "mean" and cfg.seq_parallel_communication_data_type == "fp32"
    assert cfg.data_types.keep_in_fp32_modules == "auto" and cfg.data_types.buffer_dtype is None
    assert zero.compute_grad_norm is True and zero.stage3_allgather_sequential is False
    assert "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in zero.leaf_module.classes


def test_offload_device_defaults_to_none():
    cfg, _ = load_recording({**BASE, "zero_optimization": {"stage": 3, "offload_param": {}}})
    assert cfg.zero_optimization.offload_param.device == "none"


@pytest.mark.parametrize(("given", "expected"), [("ignore", "Ignore"), ("WARN", "Warn"), ("Fail", "Fail")])
def test_tag_validation_is_case_insensitive(given, expected):
    cfg, _ = load_recording({**BASE, "checkpoint": {"tag_validation": given}})
    assert cfg.checkpoint.tag_validation == expected


@pytest.mark.parametrize(
    ("given", "expected"), [("BF16", "bf16"), ("float16", "fp16"), ("torch.float32", "fp32")]
)
def test_dtype_spellings_are_normalised(given, expected):
    cfg, _ = load_recording(
        {**BASE, "communication_data_type": given, "data_types": {"grad_accum_dtype": given}}
    )
    assert cfg.communication_data_type == expected and cfg.data_types.grad_accum_dtype == expected


def test_integral_float_is_accepted_for_int_fields():
    cfg, _ = load_recording({"train_batch_size": 32.0, "zero_optimization": {"reduce_bucket_size": 5e8}})
    assert cfg.train_batch_size == 32 and type(cfg.train_batch_size) is int
    assert type(cfg.zero_optimization.reduce_bucket_size) is int


# ---- deprecated forms ------------------------------------------------------------------------------

DEPRECATED = [
    # (config, check on cfg, old key named, new key named)
    (
        {**BASE, "zero_optimization": True},
        lambda c: c.zero_optimization.stage == 1,
        "zero_optimization",
        "stage",
    ),
    (
        {**BASE, "zero_optimization": False},
        lambda c: c.zero_optimization.stage == 0,
        "zero_optimization",
        "stage",
    ),
    (
        {**BASE, "zero_optimization": True, "allgather_size": 1000},
        lambda c: c.zero_optimization.allgather_bucket_size == 1000,
        "allgather_size",
        "zero_optimization.allgather_bucket_size",
    ),
    (
        {**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}},
        lambda c: c.zero_optimization.offload_optimizer.device == "cpu",
        "zero_optimization.cpu_offload",
        "zero_optimization.offload_optimizer",
    ),
    (
        {**BASE, "zero_optimization": {"stage": 2, "cpu_offload": False}},
        lambda c: c.zero_optimization.offload_optimizer is None,
        "zero_optimization.cpu_offload",
        "zero_optimization.offload_optimizer",
    ),
    (
        {**BASE, "zero_optimization": {"stage": 3, "cpu_offload_param": True}},
        lambda c: c.zero_optimization.offload_param.device == "cpu",
        "zero_optimization.cpu_offload_param",
        "zero_optimization.offload_param",
    ),
    (
        {**BASE, "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
        lambda c: c.zero_optimization.stage3_gather_16bit_weights_on_model_save,
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    (
        {**BASE, "bfloat16": {"enabled": True}},
        lambda c: c.bf16.enabled,
        "bfloat16",
        "bf16",
    ),
    (  # kept (every checkpoint loads at any world size), with DeepSpeed's deprecation warning
        {**BASE, "zero_optimization": {"stage": 3, "elastic_checkpoint": True}},
        lambda c: c.zero_optimization.elastic_checkpoint,
        "zero_optimization.elastic_checkpoint",
        "universal checkpointing",
    ),
]


@pytest.mark.parametrize(("config", "check", "old", "new"), DEPRECATED, ids=[d[2] for d in DEPRECATED])
def test_deprecated_form_is_mapped_with_a_warning(config, check, old, new):
    cfg, messages = load_recording(config)
    assert check(cfg)
    assert any(f"'{old}" in m and new in m and "deprecated" in m for m in messages), messages


SYNONYMS = [
    (
        {**BASE, "zero_optimization": {"stage": 3, "prefetch_bucket_size": 123}},
        lambda c: c.zero_optimization.stage3_prefetch_bucket_size == 123,
        "zero_optimization.prefetch_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
    ),
    (
        {**BASE, "zero_optimization": {"stage": 3, "param_persistence_threshold": 7}},
        lambda c: c.zero_optimization.stage3_param_persistence_threshold == 7,
        "zero_optimization.param_persistence_threshold",
        "zero_optimization.stage3_param_persistence_threshold",
    ),
    (
        {**BASE, "zero_optimization": {"stage": 3, "max_live_parameters": 9, "max_reuse_distance": 8}},
        lambda c: (
            (c.zero_optimization.stage3_max_live_parameters, c.zero_optimization.stage3_max_reuse_distance)
            == (9, 8)
        ),
        "zero_optimization.max_live_parameters",
        "zero_optimization.stage3_max_live_parameters",
    ),
]


@pytest.mark.parametrize(("config", "check", "old", "new"), SYNONYMS, ids=[d[2] for d in SYNONYMS])
def test_zero_short_names_are_synonyms_without_warning(config, check, old, new):
    """DeepSpeed accepts ZeRO-3's short names as equally valid: mapped, and no warning."""
    cfg, messages = load_recording(config)
    assert check(cfg)
    assert not messages


@pytest.mark.parametrize(
    ("old", "new", "what"),
    [("cpu_offload", "offload_optimizer", "optimizer"), ("cpu_offload_param", "offload_param", "parameter")],
)
def test_cpu_offload_false_says_nothing_is_offloaded(old, new, what):
    """DeepSpeed maps `false` to no offload block; the warning must not claim a CPU offload."""
    cfg, messages = load_recording({**BASE, "zero_optimization": {"stage": 3, old: False}})
    assert getattr(cfg.zero_optimization, new) is None
    (message,) = [m for m in messages if f"zero_optimization.{old}" in m]
    assert message == (
        f"config key 'zero_optimization.{old}': false is deprecated; it means no {what} offload, the default, "
        f"so nothing was set (remove it; 'zero_optimization.{new}' replaces it)"
    )
    assert '"cpu"' not in message


def test_cpu_offload_use_pin_memory_without_offload_says_it_has_no_effect():
    cfg, messages = load_recording(
        {**BASE, "zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}}
    )
    assert cfg.zero_optimization.offload_optimizer is None and cfg.zero_optimization.offload_param is None
    (message,) = [m for m in messages if "cpu_offload_use_pin_memory" in m]
    assert "no offload block" in message and "no effect" in message


def test_cpu_offload_use_pin_memory_sets_pin_memory():
    config = {
        **BASE,
        "zero_optimization": {
            "stage": 3,
            "cpu_offload": True,
            "cpu_offload_param": True,
            "cpu_offload_use_pin_memory": True,
        },
    }
    cfg, messages = load_recording(config)
    assert (
        cfg.zero_optimization.offload_optimizer.pin_memory and cfg.zero_optimization.offload_param.pin_memory
    )
    assert any("cpu_offload_use_pin_memory" in m for m in messages)


def test_cpu_offload_use_pin_memory_conflicts_with_explicit_pin_memory():
    config = {
        **BASE,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "cpu_offload_use_pin_memory": True,
        },
    }
    with pytest.raises(ConfigError, match=r"zero_optimization\.cpu_offload_use_pin_memory"):
        load_config(config)


# ---- "auto" ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"train_batch_size": "auto"}, "train_batch_size"),
        ({**BASE, "gradient_clipping": "auto"}, "gradient_clipping"),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
        (
            {**BASE, "optimizer": {"type": "AdamW", "params": {"betas": ["auto", 0.99]}}},
            "optimizer.params.betas[0]",
        ),
        (
            {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "AUTO"}}},
            "scheduler.params.warmup_num_steps",
        ),
    ],
)
def test_auto_is_refused_with_an_explanation(config, key):
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    message = str(caught.value)
    assert message.startswith(f"{key}:")
    assert "HF Transformers/Accelerate" in message and '"auto"' in message


def test_auto_left_inside_a_block_falls_back_to_the_default_with_a_warning():
    # Integrations leave "auto" where they have nothing to fill in; DeepSpeed drops it there.
    config = {
        **BASE,
        "fp16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
        },
    }
    with pytest.warns(ConfigWarning, match=r'"auto" left unfilled') as caught:
        cfg = load_config(config)
    message = str(caught[0].message)
    for key in ("fp16.enabled", "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch"):
        assert key in message
    assert cfg.fp16.enabled is False and cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.reduce_bucket_size == ZeroConfig().reduce_bucket_size
    assert config["fp16"] == {"enabled": "auto"}  # the caller's dict is not modified


def test_steps_per_print_infinity_means_never():
    # Accelerate writes float("inf") to silence the engine; DeepSpeed accepts it.
    assert load_config({**BASE, "steps_per_print": float("inf")}).steps_per_print is None
    assert (
        load_config(
            parse_config_text('{"train_micro_batch_size_per_gpu": 2, "steps_per_print": Infinity}')
        ).steps_per_print
        is None
    )
    assert load_config({**BASE, "steps_per_print": 7}).steps_per_print == 7
    with pytest.raises(ConfigError, match=r"^steps_per_print: expected an integer, got -Infinity"):
        load_config({**BASE, "steps_per_print": float("-inf")})


def test_pipeline_stages_auto_is_deepspeeds_own_default():
    cfg, _ = load_recording({**BASE, "pipeline": {"stages": "auto"}})
    assert cfg.pipeline.stages == "auto"


# ---- features that are not implemented, and keys DeepSpeed removed -------------------------------


def test_unsupported_keys_are_refused_in_one_error_naming_each():
    config = {
        **BASE,
        "weight_quantization": {"enabled": True},
        "checkpoint": {"tag_validation": "Warn", "use_node_local_storage": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "zenflow": {"overlap_step": True},
            "enable_sanity_checks": True,
        },
        # implemented blocks: not named
        "tensorboard": {"enabled": True, "output_path": "runs"},
        "flops_profiler": {"enabled": True},
        "activation_checkpointing": {"partition_activations": True},
        "comms_logger": {"enabled": True},
    }
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    message = str(caught.value)
    for key in (
        "weight_quantization: this block is not supported by shardspeed",
        "checkpoint.use_node_local_storage: true",
        "zero_optimization.zenflow.overlap_step: true",
        "zero_optimization.enable_sanity_checks: true",
    ):
        assert key in message
    for key in (
        "tag_validation",
        "tensorboard",
        "flops_profiler",
        "activation_checkpointing",
        "comms_logger",
    ):
        assert key not in message


@pytest.mark.parametrize(
    "key",
    ["nebula", "amp", "sparse_gradients", "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
     "progressive_layer_drop", "quantize_training"],
)  # fmt: skip
def test_keys_deepspeed_removed_are_refused_whatever_their_value(key):
    # DeepSpeed 0.19 raises on these even when disabled: a leftover block would silently change training.
    with pytest.raises(ConfigError, match=rf"^{key}: .*removed in DeepSpeed 0\.19"):
        load_config({**BASE, key: {"enabled": False}})


def test_legacy_curriculum_learning_is_kept_though_deepspeed_removed_it():
    # shardspeed builds the legacy curriculum (shardspeed/data_pipeline), so DeepSpeed 0.19.8's refusal does not apply
    block = {"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
             "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}  # fmt: skip
    assert load_config({**BASE, "curriculum_learning": block}).curriculum_learning.max_difficulty == 64


@pytest.mark.parametrize("key", ["mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"])
def test_zero_keys_deepspeed_removed_are_refused(key):
    with pytest.raises(ConfigError, match=rf"^zero_optimization\.{key}: .*removed in DeepSpeed 0\.19"):
        load_config({**BASE, "zero_optimization": {"stage": 3, key: None}})


def test_disabled_or_default_valued_features_are_accepted():
    config = {
        **BASE,
        "tensorboard": {"enabled": False, "output_path": "runs"},
        "wandb": {"enabled": False},
        "hybrid_engine": {"enabled": False, "max_out_tokens": 64},  # off: nothing in it takes effect
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
        "checkpoint": {"load_universal": False},
        "comms_logger": {"enabled": False, "verbose": True},
        "compile": {"deepcompile": False},
        "datastates_ckpt": False,
        "zero_optimization": {"stage": 2, "parameter_alignment": False},
    }
    _, messages = load_recording(config)
    assert messages == []


def test_implemented_keys_do_not_warn():
    config = {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True, "loss_scale": 128},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {}},
        "gradient_clipping": 0.5,
        "prescale_gradients": True,
        "communication_data_type": "fp32",
        "zero_optimization": {"stage": 2, "overlap_comm": True, "round_robin_gradients": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "steps_per_print": 10,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "dataloader_drop_last": True,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "checkpoint": {"tag_validation": "Ignore"},
    }
    cfg, messages = load_recording(config, world_size=4)
    assert messages == []
    assert cfg.train_micro_batch_size_per_gpu == 2 and cfg.zero_optimization.overlap_comm is True


def test_implemented_set_is_extendable_and_names_real_keys():
    from shardspeed.config import ShardspeedConfig

    top_level = {name for name in ShardspeedConfig.__dataclass_fields__}
    assert {key.split(".")[0] for key in IMPLEMENTED} <= top_level


def test_booleans_written_as_0_or_1_are_taken_as_deepspeeds_blocks_take_them():
    from shardspeed.config import ConfigError, load_config

    cfg = load_config({"train_batch_size": 1, "zero_allow_untested_optimizer": 1, "wall_clock_breakdown": 0})
    assert cfg.zero_allow_untested_optimizer is True and cfg.wall_clock_breakdown is False
    with pytest.raises(
        ConfigError, match=r"zero_allow_untested_optimizer: expected a boolean \(true/false\), got 2"
    ):
        load_config({"train_batch_size": 1, "zero_allow_untested_optimizer": 2})


def test_members_of_deepspeeds_enums_stand_for_their_values():
    from shardspeed.zero.offload_kinds import OffloadDeviceEnum

    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": OffloadDeviceEnum.none},
            "offload_optimizer": {"device": OffloadDeviceEnum.cpu},
        },
    }
    zero = load_config(raw).zero_optimization
    assert zero.offload_param.device == "none" and zero.offload_optimizer.device == "cpu"
    assert type(zero.offload_optimizer.device) is str
    # the dict as read (kept with the engine and saved in checkpoints) holds the plain values
    from shardspeed.config.loader import read_config_source

    plain = read_config_source(raw)
    assert type(plain["zero_optimization"]["offload_param"]["device"]) is str
    assert (
        raw["zero_optimization"]["offload_param"]["device"] is OffloadDeviceEnum.none
    )  # the caller's is kept
    untouched = {"train_micro_batch_size_per_gpu": 1}
    assert read_config_source(untouched) is untouched
