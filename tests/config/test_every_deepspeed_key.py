"""Every config key of DeepSpeed 0.19.8 is honoured or refused naming it; none is accepted and ignored.

The keys come from `deepspeed_0_19_8_keys.txt` (derived by reading DeepSpeed 0.19.8's package; DeepSpeed is
not imported here). For each key a config setting it to a value other than its default is loaded (inside
an enabled block where the key belongs to a switchable one). Either the load is refused with a
`ConfigError` that names the key, or the key is honoured, and `HONOURED_BY` names the test that shows its
effect, a test that exists. Keys DeepSpeed itself reads and never
uses (`disable_allgather`, `tensor_parallel.tp.tp_grain_size`) are refused when set: they would do nothing.
"""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest

from shardspeed.config import ConfigError, ShardspeedConfig, load_config
from shardspeed.config.build import Key, _schema

HERE = Path(__file__).parent
TESTS = HERE.parent
KEYS = [
    line for line in (HERE / "deepspeed_0_19_8_keys.txt").read_text().splitlines() if line and line[0] != "#"
]
BASE = {"train_micro_batch_size_per_gpu": 2}

EFFECTS = "test_config_effects.py::test_config_keys_take_effect"
FEATURES = "test_engine_features.py::test_surface_and_gradient_keys"
ZERO3 = "test_engine_features.py::test_zero3_attributes_knobs_and_offload_states"
KNOBS = "test_zero_knobs.py::test_zero_keys_keep_parity_and_take_effect"
OFFLOAD = "test_zero_infinity.py::test_every_offload_combination_trains_like_no_offload"
DEPRECATED = "config/test_config_compat.py::test_deprecated_form_is_mapped_with_a_warning"
MONITORS = "test_observability.py::test_two_rank_run_writes_every_monitor_profiler_and_comms_file"

AUTOTUNE = "autotuning/test_autotuning_search.py::"
AUTOTUNE_RUN = "autotuning/test_autotuning_run.py::test_tune_then_run_trains_with_the_best_measured_config"
AUTOTUNE_PROBE = AUTOTUNE + "test_probe_measures_the_profiled_steps_writes_the_metrics_and_ends_the_run"
AUTOTUNE_SPACES = AUTOTUNE + "test_stages_and_offload_choices_are_spaces_in_order_and_the_best_is_picked"
AUTOTUNE_BATCH = AUTOTUNE + "test_max_and_min_train_batch_size_and_mp_size_set_the_batch_arithmetic"

# key path (or a block: its keys, unless refused) -> the test that shows the key taking effect
ZEROPP_BYTES = "test_zeropp.py::test_bytes_per_step_within_and_across_nodes_match_the_formulas"

AUTOEP_TRAIN = "test_autoep_parallel.py::test_ep2_training_matches_one_process_at_zero_0_1_2"
AUTOEP_REPLACE = "test_autoep.py::test_replaced_mixtral_block_matches_the_source"
AUTOEP_CHECKS = "test_autoep.py::test_validation_names_the_key"
AUTOEP_OVERRIDES = "test_autoep.py::test_block_keys_override_the_preset_in_detection"

HONOURED_BY = {
    # AutoEP: the block trains expert-parallel; its checks (and refusals) run when the engine starts
    "expert_parallel": AUTOEP_TRAIN,
    "expert_parallel.moe_layer_pattern": AUTOEP_OVERRIDES,
    "expert_parallel.router_pattern": AUTOEP_OVERRIDES,
    "expert_parallel.expert_pattern": AUTOEP_OVERRIDES,
    "expert_parallel.expert_w2": AUTOEP_OVERRIDES,
    "expert_parallel.expert_w3": AUTOEP_OVERRIDES,
    "expert_parallel.num_experts_attr": AUTOEP_OVERRIDES,
    "expert_parallel.top_k_attr": AUTOEP_OVERRIDES,
    "expert_parallel.top_k": AUTOEP_OVERRIDES,
    "expert_parallel.score_func": AUTOEP_OVERRIDES,
    "expert_parallel.route_norm": AUTOEP_OVERRIDES,
    "expert_parallel.has_shared_experts": AUTOEP_OVERRIDES,
    "expert_parallel.shared_experts_pattern": AUTOEP_OVERRIDES,
    "expert_parallel.shared_experts_gate_pattern": AUTOEP_OVERRIDES,
    "expert_parallel.expert_activation": AUTOEP_OVERRIDES,
    "expert_parallel.use_grouped_mm": AUTOEP_REPLACE,
    "expert_parallel.disable_triton_grouped_mm": AUTOEP_REPLACE,
    "expert_parallel.gate_up_impl": "test_autoep.py::test_grouped_experts_loop_and_grouped_mm_compute_each_experts_swiglu",
    "expert_parallel.route_scale": "test_autoep.py::test_route_scale_comes_from_the_block_then_the_model",
    "expert_parallel.routed_scaling_factor": "test_autoep.py::test_route_scale_comes_from_the_block_then_the_model",
    "expert_parallel.num_expert_groups": "test_autoep.py::test_router_scale_norm_and_group_limited_routing",
    "expert_parallel.num_limited_groups": "test_autoep.py::test_router_scale_norm_and_group_limited_routing",
    "expert_parallel.async_split_plan": AUTOEP_CHECKS,
    "expert_parallel.combine_impl": AUTOEP_CHECKS,
    "expert_parallel.comm_backend": AUTOEP_CHECKS,
    "expert_parallel.comm_max_tokens_per_rank": AUTOEP_CHECKS,
    "expert_parallel.comm_num_sm": AUTOEP_CHECKS,
    "expert_parallel.comm_qp_margin": AUTOEP_CHECKS,
    "expert_parallel.expert_tensor_parallel_size": AUTOEP_CHECKS,
    "expert_parallel.load_balance_coeff": AUTOEP_CHECKS,
    "expert_parallel.row_weighting_impl": AUTOEP_CHECKS,
    "expert_parallel.score_apply": AUTOEP_CHECKS,
    "expert_parallel.preset_model": AUTOEP_CHECKS,
    "expert_parallel.expert_w1": AUTOEP_CHECKS,
    "train_batch_size": "config/test_config_batch.py::test_inference_table",
    "train_micro_batch_size_per_gpu": "config/test_config_batch.py::test_inference_table",
    "gradient_accumulation_steps": "config/test_config_batch.py::test_inference_table",
    "steps_per_print": EFFECTS,
    "wall_clock_breakdown": EFFECTS,
    "memory_breakdown": EFFECTS,
    "dump_state": FEATURES,
    "log_level": FEATURES,
    "disable_python_gc": FEATURES,
    "communication_data_type": EFFECTS,
    "seq_parallel_communication_data_type": FEATURES,
    "prescale_gradients": EFFECTS,
    "gradient_predivide_factor": EFFECTS,
    "gradient_allreduce_op": FEATURES,
    "gradient_clipping": "test_engine_parity.py::test_fp32_parity_with_single_process",
    "fp16": "test_engine_fp16_overflow.py::test_overflow_skips_step_on_all_ranks",
    "fp16.auto_cast": EFFECTS,
    "fp16.hysteresis": "test_loss_scaler.py::test_hysteresis_delays_the_first_decrease",
    "fp16.consecutive_hysteresis": "test_loss_scaler.py::test_hysteresis_is_restored_by_growth_or_consecutive_mode",
    "fp16.loss_scale_window": "test_loss_scaler.py::test_scale_grows_after_a_clean_window",
    "fp16.min_loss_scale": "test_loss_scaler.py::test_minimum_scale_raises_with_advice",
    "fp16.loss_scale": "test_loss_scaler.py::test_static_scale_never_changes_and_state_round_trips",
    "bf16.enabled": "test_engine_parity.py::test_mixed_precision_close_to_fp32",
    "bf16.check_grad_overflow": FEATURES,
    "bf16.immediate_grad_update": EFFECTS,
    "bfloat16": DEPRECATED,
    "torch_autocast": "test_engine_features.py::test_torch_autocast_and_compile",
    "data_types": "test_engine_parts.py::test_keep_in_fp32_modules_auto_reads_the_models_own_list_and_wins_over_buffer_dtype",
    "data_types.buffer_dtype": "test_engine_parts.py::test_buffer_dtype_casts_the_floating_buffers",
    "data_types.grad_accum_dtype": EFFECTS,
    "data_types.param_dtype": "config/test_config_errors.py::test_malformed_config_is_refused_naming_the_key",
    "optimizer": "test_optim.py::test_name_to_class",
    "optimizer.legacy_fusion": EFFECTS,
    "scheduler": "test_lr_schedules.py::test_build_deepspeed_names_case_insensitive",
    "zero_allow_untested_optimizer": "test_optim.py::test_zero_tested_optimizers",
    "zero_force_ds_cpu_optimizer": EFFECTS,
    "dataloader_drop_last": EFFECTS,
    "tensorboard": MONITORS,
    "wandb": MONITORS,
    "csv_monitor": MONITORS,
    "comet": MONITORS,
    "flops_profiler": MONITORS,
    "comms_logger": "test_comms_logger.py::test_bytes_per_step_equal_the_zero_formula_and_user_ops_are_logged",
    "timers": "test_throughput_timer.py::test_synchronizes_only_when_asked_and_does_nothing_when_disabled",
    "activation_checkpointing": "test_activation_checkpointing.py::test_configure_from_config_block_and_explicit_overrides",
    "pipeline": "test_pipe_parity.py::test_two_stages_one_replica",
    "checkpoint.tag_validation": "test_checkpoint_bad_input.py::test_bad_saves_fail_the_same_way_on_every_rank_and_keep_the_previous_checkpoint",
    "checkpoint.load_universal": "test_universal_checkpoint.py::test_resume_from_universal_matches_uninterrupted_run",
    "aio": OFFLOAD,
    "sequence_parallel_size": "test_sequence_parallel.py::test_sp2_on_two_ranks_matches_one_process",
    "data_parallel_size": FEATURES,
    "vocabulary_size": "config/test_every_deepspeed_key.py::test_vocabulary_size_not_a_multiple_of_8_warns",
    "tensor_parallel": "test_tensor_parallel_training.py::test_tp2_equals_one_process",
    "allgather_size": DEPRECATED,
    "zero_optimization.stage": "test_zero_parity.py::test_zero_stages_match_reference",
    "zero_optimization.reduce_scatter": KNOBS,
    "zero_optimization.overlap_comm": KNOBS,
    "zero_optimization.reduce_bucket_size": KNOBS,
    "zero_optimization.allgather_bucket_size": KNOBS,
    "zero_optimization.sub_group_size": KNOBS,
    "zero_optimization.stage3_prefetch_bucket_size": KNOBS,
    "zero_optimization.stage3_param_persistence_threshold": KNOBS,
    "zero_optimization.stage3_model_persistence_threshold": KNOBS,
    "zero_optimization.stage3_max_live_parameters": KNOBS,
    "zero_optimization.stage3_max_reuse_distance": KNOBS,
    "zero_optimization.contiguous_gradients": EFFECTS,
    "zero_optimization.use_multi_rank_bucket_allreduce": EFFECTS,
    "zero_optimization.round_robin_gradients": EFFECTS,
    "zero_optimization.allgather_partitions": EFFECTS,
    "zero_optimization.elastic_checkpoint": EFFECTS,
    "zero_optimization.memory_efficient_linear": EFFECTS,
    "zero_optimization.stage3_module_granularity_threshold": EFFECTS,
    "zero_optimization.compute_grad_norm": FEATURES,
    "zero_optimization.stage3_allgather_sequential": ZERO3,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": ZERO3,
    "zero_optimization.leaf_module": ZERO3,
    "zero_optimization.log_trace_cache_warnings": ZERO3,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "test_zero_api.py::test_save_16bit_model_needs_the_gather_flag_under_stage3",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": DEPRECATED,
    "zero_optimization.offload_optimizer": "test_zero_offload.py::test_offload_trains_exactly_like_no_offload",
    "zero_optimization.offload_optimizer.pin_memory": "test_cuda.py::test_resume_on_cuda_is_exact_and_in_place",
    "zero_optimization.offload_optimizer.buffer_count": OFFLOAD,
    "zero_optimization.offload_optimizer.pipeline_read": OFFLOAD,
    "zero_optimization.offload_optimizer.pipeline_write": OFFLOAD,
    "zero_optimization.offload_optimizer.nvme_path": OFFLOAD,
    "zero_optimization.offload_param": OFFLOAD,
    "zero_optimization.cpu_offload": DEPRECATED,
    "zero_optimization.cpu_offload_param": DEPRECATED,
    "zero_optimization.cpu_offload_use_pin_memory": "config/test_config_compat.py::test_cpu_offload_use_pin_memory_sets_pin_memory",
    "zero_optimization.zero_quantized_weights": ZEROPP_BYTES,
    "zero_optimization.zero_hpz_partition_size": ZEROPP_BYTES,
    "zero_optimization.zero_quantized_gradients": ZEROPP_BYTES,
    "zero_optimization.zero_quantized_nontrainable_weights": "test_zeropp_combos.py::test_frozen_weights_are_stored_as_int8_blocks_of_each_shard",
    # Removed in DeepSpeed 0.19, kept here with 0.18.9's keys; its sub-keys are checked in test_compression_config.py
    "compression_training": "test_compression_engine.py::test_deepspeed_0189_script_runs_unchanged",
    "curriculum_learning": "test_data_efficiency_engine.py::test_legacy_curriculum_passes_seqlen_each_step",
    "data_efficiency": "test_data_efficiency_engine.py::test_curriculum_sampler_splits_global_batches_over_ranks",
    "data_efficiency.seed": "test_data_sampler.py::test_seed_changes_the_order",
    "data_efficiency.data_routing": "test_data_efficiency_engine.py::test_random_ltd_layers_run_on_the_kept_tokens",
    # the autotuner (tests/autotuning): the end-to-end run, the search with simulated runs, the engine's probe
    "autotuning": AUTOTUNE_RUN,
    "autotuning.enabled": "autotuning/test_autotuning_run.py::test_engines_measure_the_profiled_steps_then_end_the_run",
    "autotuning.start_profile_step": AUTOTUNE_PROBE,
    "autotuning.end_profile_step": AUTOTUNE_PROBE,
    "autotuning.metric_path": AUTOTUNE_PROBE,
    "autotuning.metric": AUTOTUNE + "test_latency_is_minimised",
    "autotuning.fast": AUTOTUNE + "test_fast_false_tunes_the_stage_knobs_within_the_trial_budget",
    "autotuning.tuner_num_trials": AUTOTUNE + "test_fast_false_tunes_the_stage_knobs_within_the_trial_budget",
    "autotuning.tuner_type": AUTOTUNE + "test_tuners_order_and_early_stopping",
    "autotuning.tuner_early_stopping": AUTOTUNE + "test_tuners_order_and_early_stopping",
    "autotuning.results_dir": AUTOTUNE_SPACES,
    "autotuning.exps_dir": AUTOTUNE_SPACES,
    "autotuning.overwrite": AUTOTUNE + "test_finished_experiment_is_reused_when_overwrite_is_false",
    "autotuning.arg_mappings": AUTOTUNE
    + "test_arg_mappings_write_the_experiment_values_into_the_script_arguments",
    "autotuning.max_train_batch_size": AUTOTUNE_BATCH,
    "autotuning.mp_size": AUTOTUNE_BATCH,
    "autotuning.num_tuning_micro_batch_sizes": AUTOTUNE_BATCH,
    "autotuning.min_train_batch_size": AUTOTUNE + "test_min_train_batch_size_skips_smaller_global_batches",
    "autotuning.max_train_micro_batch_size_per_gpu": AUTOTUNE
    + "test_micro_batch_search_doubles_until_a_failure_then_refines",
    "autotuning.min_train_micro_batch_size_per_gpu": AUTOTUNE
    + "test_micro_batch_search_stops_at_a_throughput_plateau",
    "hybrid_engine": "test_hybrid_engine.py::test_generate_matches_the_unsharded_model_and_training_is_unchanged",
    "hybrid_engine.max_out_tokens": "test_hybrid_engine.py::test_pin_parameters_release_inference_cache_and_max_out_tokens",
    "hybrid_engine.release_inference_cache": "test_hybrid_engine.py::test_pin_parameters_release_inference_cache_and_max_out_tokens",
    "hybrid_engine.pin_parameters": "test_hybrid_engine.py::test_pin_parameters_release_inference_cache_and_max_out_tokens",
    "hybrid_engine.inference_tp_size": "test_hybrid_engine_tp.py::test_tp2_generates_the_tokens_tp1_generates",
    "hybrid_engine.tp_gather_partition_size": "test_hybrid_engine_tp.py::test_tp2_holds_half_of_the_layer_weights",
    "zero_optimization.zenflow": "test_zenflow.py::test_selected_columns_every_step_and_the_rest_at_the_interval",
    "zero_optimization.zenflow.select_strategy": "test_zenflow.py::test_schedule_intervals",
    "zero_optimization.zenflow.select_interval": "test_zenflow.py::test_schedule_intervals",
    "zero_optimization.zenflow.update_interval": "test_zenflow.py::test_schedule_intervals",
    "zero_optimization.zenflow.full_warm_up_rounds": "test_zenflow.py::test_schedule_intervals",
    "zero_optimization.zenflow.auto_ratio": "test_zenflow.py::test_auto_update_interval",
    "zero_optimization.zenflow.offload": "test_zenflow.py::test_selective_adamw_updates_only_the_selected_columns",
}


# Context a key needs to be meaningful (or valid) on its own.
CONTEXT = {
    "zero_optimization.compute_grad_norm": {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0},
    "data_types.param_dtype": {"fp16": {"enabled": True}},
    "zero_optimization.offload_param": {"zero_optimization": {"stage": 3}},
    "zero_optimization.cpu_offload_param": {"zero_optimization": {"stage": 3}},
    "zero_optimization.cpu_offload": {"zero_optimization": {"stage": 2}},
    "zero_optimization.offload_optimizer": {"zero_optimization": {"stage": 2}},
    "zero_optimization.zenflow": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "tensor_parallel.tp.tp_size": {"tensor_parallel": {"autotp_size": 2}},
    "optimizer": {"optimizer": {"type": "AdamW"}},
    "scheduler": {"scheduler": {"type": "WarmupLR"}},
}
VALUES = {  # where the generated value would be invalid rather than merely non-default
    "torch_autocast.dtype": "bf16",
    "data_types.param_dtype": "fp16",
    "tensor_parallel.tp.tp_size": 2,
    "tensor_parallel.tp": {"tp_grain_size": 8},  # the inner block's other keys: defaults only
    "optimizer.type": "SGD",
    "tensor_parallel.vocab_parallel_ce_backend": "liger",  # DeepSpeed's other backend
    "scheduler.type": "OneCycle",
    "zero_optimization.cpu_offload": True,
    "zero_optimization.zenflow.select_strategy": "epoch",  # (select_interval "auto" goes with "auto" only)
    "zero_optimization.cpu_offload_param": True,
    "zero_optimization.cpu_offload_use_pin_memory": True,
    "allgather_size": 1000,
}


# -- a non-default value for a key, read off shardspeed's typed schema --------------------------------------------


def _field(path: str):
    """(type annotation, default, owning block class or None) of a key path; (None, None, None) when the key is
    inside a free-form object or not a field."""
    cls, tp, default = ShardspeedConfig, None, None
    parts = path.split(".")
    for i, name in enumerate(parts):
        if cls is None:
            return None, None, None
        schema = _schema(cls)
        name = schema.aliases.get(name, name)
        if name not in schema.hints:
            return None, None, cls if i == len(parts) - 1 else None
        tp = schema.hints[name]
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # fmt: skip
        cls = _block_class(tp)
    return tp, default, cls


def _block_class(tp):
    for arg in (tp, *typing.get_args(tp), *[a for t in typing.get_args(tp) for a in typing.get_args(t)]):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _sample(tp, default, keys: tuple[Key, ...] = ()) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        args = get_args(tp)
        return _sample(args[0], default, keys + tuple(a for a in args[1:] if isinstance(a, Key)))
    if origin in (Union, typing.types.UnionType):
        for arm in (a for a in get_args(tp) if a is not type(None)):
            try:
                return _sample(arm, default, keys)
            except StopIteration:  # a one-value Literal arm holding the default: try the next arm
                continue
    if origin is Literal:
        return next(c for c in get_args(tp) if c != default)
    if origin is list:
        (item,) = get_args(tp)
        return [_sample(item, None)]
    if tp is bool:
        return not default
    if tp in (int, float):
        return _number(tp, default, keys)
    if tp is str:
        return "sample"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return {}
    return {"sample": 1}  # dict, Any, free-form


def _number(tp, default, keys: tuple[Key, ...]):
    """A number other than `default` within the field's range."""
    default = default if isinstance(default, int | float) and not isinstance(default, bool) else None
    for candidate in (default * 2 if default else None, (default or 0) + 1, (default or 1) / 2):
        if candidate is not None and candidate != default and all(_in_range(k, candidate) for k in keys):
            return int(candidate) if tp is int and float(candidate).is_integer() else candidate
    raise AssertionError(f"no sample number for {tp} with default {default}")


def _in_range(key: Key, value) -> bool:
    return not ((key.gt is not None and value <= key.gt) or (key.ge is not None and value < key.ge)
                or (key.le is not None and value > key.le))  # fmt: skip


def _set(config: dict, path: str, value) -> None:
    node = config
    *parents, last = path.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value


def _config_for(key: str) -> dict:
    config = {**BASE}
    for prefix, context in CONTEXT.items():
        if key == prefix or key.startswith(prefix + "."):
            for name, value in context.items():
                config[name] = {**config.get(name, {}), **value} if isinstance(value, dict) else value
    tp, default, _ = _field(key)
    if key in VALUES:
        value = VALUES[key]
    elif key.endswith(".enabled"):
        value = True
    else:
        value = _sample(tp, default) if tp is not None else 2
    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):  # inside a switchable block: switch it on
        block = ".".join(parts[:depth])
        _, _, cls = _field(block)
        if (
            cls is not None
            and "enabled" in {f.name for f in dataclasses.fields(cls)}
            and parts[-1] != "enabled"
        ):
            _set(config, f"{block}.enabled", True)
            break
    _set(config, key, value)
    return config


def _evidence(key: str) -> str | None:
    prefixes = [p for p in HONOURED_BY if key == p or key.startswith(p + ".")]
    return HONOURED_BY[max(prefixes, key=len)] if prefixes else None


def _test_exists(node_id: str) -> bool:
    file, _, name = node_id.partition("::")
    path = TESTS / file
    return path.is_file() and re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M) is not None


def _block_kind(key: str) -> str | None:
    """ "switched" / "present" / "plain" for a key whose value is a block, None for a plain key."""
    tp, _, _ = _field(key)
    cls = _block_class(tp) if tp is not None else None
    if cls is None:
        return None
    if "enabled" in {f.name for f in dataclasses.fields(cls)}:
        return "switched"
    return "present" if getattr(cls, "ACTIVE_WHEN_PRESENT", False) else "plain"


@pytest.mark.parametrize("key", KEYS)
def test_every_deepspeed_key_is_honoured_or_refused_naming_it(key):
    kind = _block_kind(key)
    if kind == "plain" and any(k.startswith(key + ".") for k in KEYS):
        return  # a block that does nothing by itself: its keys are checked one by one
    config = _config_for(key)
    if kind == "switched":
        _set(config, f"{key}.enabled", True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(config)
    except ConfigError as err:
        message = str(err)
        assert not message.startswith("unknown key"), f"{key} is not a known key: {message}"
        assert key in message or key.replace("kernel_inject", "replace_with_kernel_inject") in message, (
            f"refusing {config} does not name {key}: {message}"
        )
        return
    evidence = _evidence(key) or (_evidence(f"{key}.enabled") if kind == "switched" else None)
    assert evidence is not None, (
        f"{key} is accepted (config {config}) but no test showing its effect is listed"
    )
    assert _test_exists(evidence), f"{key}: the evidence {evidence} does not exist"


def test_every_refusal_names_only_real_keys_and_the_list_is_complete():
    assert len(KEYS) == len(set(KEYS)) > 300
    assert {"torch_autocast.lower_precision_safe_modules", "zero_optimization.leaf_module.classes", "compile.passes",
            "data_types.keep_in_fp32_modules", "log_level", "nebula"} <= set(KEYS)  # fmt: skip
    for key, node in HONOURED_BY.items():
        assert _test_exists(node), f"{key}: {node} does not exist"


def test_vocabulary_size_not_a_multiple_of_8_warns():
    from shardspeed.config import ConfigWarning

    with pytest.warns(ConfigWarning, match="vocabulary_size 50257 is not a multiple of 8"):
        load_config({**BASE, "vocabulary_size": 50257})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({**BASE, "vocabulary_size": 50304})
