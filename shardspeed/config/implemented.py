"""Which config keys shardspeed implements; every other DeepSpeed key is refused with an error naming it.

To mark a feature as built, add its key path to ``IMPLEMENTED`` (a whole block, e.g. ``"tensorboard"``,
or one key inside a block, e.g. ``"checkpoint.load_universal"``) and update docs/configuration.md.

Two kinds of refusal, both ``ConfigError``s that name the key:

* ``refuse_removed`` (before the config is built): keys DeepSpeed 0.19 itself removed. DeepSpeed refuses
  them whenever they are present, whatever their value, and so does shardspeed, with DeepSpeed's reason,
  unless the feature is implemented here (its key in ``IMPLEMENTED``).
* ``refuse_unsupported`` (after): a key of a feature that is not implemented, set so that it would change
  behaviour. A block with an ``enabled`` switch counts only when enabled, a block that is on by presence
  (``ACTIVE_WHEN_PRESENT``) whenever present, any other key only when its value differs from the default:
  a key restating its default, or a switched-off block, changes nothing here or in DeepSpeed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .build import show
from .errors import ConfigError

__all__ = ["IMPLEMENTED", "REMOVED_IN_DEEPSPEED", "refuse_removed", "refuse_unsupported"]

IMPLEMENTED: frozenset[str] = frozenset(
    {
        "expert_parallel",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "fp16.enabled",
        "fp16.auto_cast",
        "fp16.loss_scale",
        "fp16.initial_scale_power",
        "fp16.loss_scale_window",
        "fp16.hysteresis",
        "fp16.consecutive_hysteresis",
        "fp16.min_loss_scale",
        "bf16.enabled",
        # Gradients are added into their fp32 accumulator by a hook as each one is produced, whichever value
        # this has: DeepSpeed's two orders give the same sums.
        "bf16.immediate_grad_update",
        "bf16.check_grad_overflow",
        "torch_autocast",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        # ZeRO: every stage, and the keys the engine honours. Some are honoured by construction:
        # gradients always live in contiguous buckets (contiguous_gradients), every rank owns a slice of
        # every bucket (round_robin_gradients' balance), one collective per bucket
        # (use_multi_rank_bucket_allreduce), checkpoints always load at any world size
        # (elastic_checkpoint), zero.Init never replaces F.linear, so both values of memory_efficient_linear
        # compute the same plain linear, and stage 3 already packs small modules into one gathered unit
        # (stage3_module_granularity_threshold: a threshold only merges what units merge anyway).
        "zero_optimization.stage",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.overlap_comm",
        "zero_optimization.compute_grad_norm",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_module_granularity_threshold",
        "zero_optimization.stage3_allgather_sequential",
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        "zero_optimization.log_trace_cache_warnings",
        "zero_optimization.leaf_module",
        "zero_optimization.memory_efficient_linear",
        "zero_optimization.pipeline_loading_checkpoint",  # stage 3: a machine's ranks load one after another
        "zero_optimization.legacy_stage1",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.pipeline_read",
        "zero_optimization.offload_optimizer.pipeline_write",
        "zero_optimization.offload_param",
        # ZenFlow (zero/zenflow/): all but the overlapped variant's keys
        "zero_optimization.zenflow.topk_ratio",
        "zero_optimization.zenflow.select_strategy",
        "zero_optimization.zenflow.select_interval",
        "zero_optimization.zenflow.update_interval",
        "zero_optimization.zenflow.offload",
        "zero_optimization.zenflow.auto_ratio",
        "zero_optimization.zenflow.full_warm_up_rounds",
        "zero_optimization.zenflow.steps_per_epoch",
        # ZeRO++ (zero/zeropp/): quantized weight gathers, hpZ secondary partitions, quantized gradients,
        # int8 frozen weights. zeropp_loco_param is refused there (DeepSpeed removed LoCo).
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.zero_quantized_gradients",
        "zero_optimization.zero_quantized_nontrainable_weights",
        "aio.block_size",
        "aio.queue_depth",
        "aio.intra_op_parallelism",
        "aio.single_submit",
        "aio.overlap_events",
        "data_types",
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "log_level",
        "disable_python_gc",
        "vocabulary_size",
        "dataloader_drop_last",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "checkpoint.tag_validation",
        "checkpoint.load_universal",
        "activation_checkpointing",
        "tensorboard",
        "csv_monitor",
        "wandb",
        "comet",
        "flops_profiler",
        "comms_logger",
        "timers",
        # The pipeline engine reads the whole block; pipe_partitioned/grad_partitioned only matter with a
        # tensor-parallel axis, where DeepSpeed splits transfers between stages over the tensor ranks.
        "pipeline",
        "sequence_parallel_size",  # Ulysses: sequence groups from the topology (runtime/layout.py)
        "data_parallel_size",
        "tensor_parallel.autotp_size",
        "tensor_parallel.vocab_parallel_lm_head",
        "tensor_parallel.vocab_parallel_ce_backend",
        "tensor_parallel.partition_config",
        "tensor_parallel.dtype",  # recorded by tp_model_init; checked against the precision blocks
        "tensor_parallel.tp",
        "tensor_parallel.replace_with_kernel_inject",  # true is refused by the block itself
        "tensor_parallel.preset_model",  # ditto
        "compression_training",  # shardspeed/compression; the engine steps its scheduler
        # shardspeed/data_pipeline: curriculum sampling and random-LTD; dynamic_batching and random-LTD's
        # layer_token_lr_schedule are refused below. The legacy curriculum_learning block, which DeepSpeed
        # 0.19.8 removed, is kept (the engine passes curriculum_seqlen to the model's forward).
        "curriculum_learning",
        "data_efficiency.enabled",
        "data_efficiency.seed",
        "data_efficiency.data_sampling.enabled",
        "data_efficiency.data_sampling.num_epochs",
        "data_efficiency.data_sampling.num_workers",
        "data_efficiency.data_sampling.pin_memory",
        "data_efficiency.data_sampling.curriculum_learning",
        "data_efficiency.data_routing.enabled",
        "data_efficiency.data_routing.random_ltd.enabled",
        "data_efficiency.data_routing.random_ltd.total_layer_num",
        "data_efficiency.data_routing.random_ltd.random_ltd_layer_num",
        "data_efficiency.data_routing.random_ltd.random_ltd_layer_id",
        "data_efficiency.data_routing.random_ltd.model_mask_name",
        "data_efficiency.data_routing.random_ltd.model_type",
        "data_efficiency.data_routing.random_ltd.hidden_state_order",
        "data_efficiency.data_routing.random_ltd.random_ltd_schedule",
        # `deepspeed --autotuning` (shardspeed/autotuning) and the engine's profiled exit (runtime/autotuning_probe.py);
        # model_info, model_info_path and tuner_type "model_based" are refused by the block itself
        "autotuning",
        "hybrid_engine",  # runtime/hybrid_engine.py; the block refuses what it cannot honour
    }
)

# Keys DeepSpeed 0.19 removed, and why (DeepSpeed's reasons, in shardspeed's words). DeepSpeed raises on
# any of them, whatever the value, instead of ignoring a block that would silently change the training.
REMOVED_IN_DEEPSPEED: dict[str, str] = {
    "nebula": "Nebula checkpointing was removed; checkpoints would silently fall back to torch.save",
    "compression_training": "the compression library was removed; the model would silently train unquantized",
    "amp": "NVIDIA Apex AMP support was removed; use 'fp16', 'bf16' or 'torch_autocast'",
    "quantize_training": "Mixture-of-Quantization (MoQ) was removed",
    "sparse_gradients": "sparse reduction of dense nn.Embedding gradients was removed (an embedding built with "
    "sparse=True needs no flag)",
    "eigenvalue": "eigenvalue-based Mixture-of-Quantization was removed",
    "sparse_attention": "Sparse Attention was removed",
    "elasticity": "elastic training was removed; set train_batch_size / train_micro_batch_size_per_gpu / "
    "gradient_accumulation_steps directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "the legacy top-level curriculum_learning was removed; DeepSpeed's replacement is "
    "data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
    "zero_optimization.mics_shard_size": "MiCS sharding was removed",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS sharding was removed",
    "zero_optimization.zeropp_loco_param": "LoCo-ZeRO++ was removed; remove the key to use ZeRO++ quantized "
    "gradients without LoCo error feedback",
}

# Why a key is refused, where a few words help more than "not supported" (longest matching prefix wins).
_REASONS: dict[str, str] = {
    "disable_allgather": "DeepSpeed parses it and never uses it; set to true it would do nothing here either",
    "managed_gradient_accumulation": "the script owning the accumulation boundary is not implemented; keep "
    "the default (true) and set gradient_accumulation_steps",
    "use_data_before_expert_parallelism": "expert-parallel groups are consecutive data-parallel ranks",
    "data_efficiency.data_sampling.dynamic_batching": "dynamic batching (variable batch size and LR scaling) "
    "is not implemented; batches have train_micro_batch_size_per_gpu samples",
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule": "DeepSpeed itself raises "
    "NotImplementedError for it (work in progress there); use the scheduler block",
    "weight_quantization": "weight quantization at training time is not implemented",
    "compile": "DeepCompile is not implemented; engine.compile() (torch.compile of the module) needs no "
    "config",
    "datastates_ckpt": "DataStates asynchronous checkpointing is not implemented",
    "checkpoint.use_node_local_storage": "node-local checkpoint storage is not implemented (every rank "
    "must see the checkpoint folder)",
    "checkpoint.parallel_write": "parallel pipeline-stage writes are not implemented",
    "checkpoint.checkpoint_serialization": "checkpoints are always written with torch's zip serialization",
    "checkpoint.writer": "DeepSpeed's fast checkpoint writer is not implemented (checkpoints use torch.save)",
    "fp16.fp16_master_weights_and_grads": "master weights are always fp32",
    "bf16.bf16_master_weights_and_grads": "master weights are always fp32",
    "bf16.bf16_optimizer_states": "optimizer state is always fp32",
    "aio.use_gds": "GPUDirect Storage is not available (NVMe I/O goes through the host)",
    "tensor_parallel": "this tensor-parallel option is not implemented for training",
    "zero_optimization.zenflow.overlap_step": "ZenFlow's overlapped variant (the host step in a separate process, "
    "one update interval behind) is not built; the host step runs in the training step",
    "zero_optimization.zenflow.pt_reserved_cores_perc": "it splits cores for ZenFlow's overlapped variant, which "
    "is not built",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload is not implemented",
    "zero_optimization.offload_optimizer.super_offload": "SuperOffload is not implemented",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "SuperOffload is not implemented",
    "zero_optimization.offload_optimizer.fast_init": "fast NVMe initialisation is not implemented",
    "zero_optimization.parameter_alignment": "flat buffers are packed without alignment padding",
    "zero_optimization.enable_sanity_checks": "DeepSpeed's internal sanity checks have no counterpart",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "the Muon optimizer is not provided",
}


def refuse_removed(config: dict[str, Any]) -> None:
    """Raise for any key DeepSpeed 0.19 removed that is present in the raw ``config`` (and not implemented)."""
    found = []
    zero = config.get("zero_optimization")
    for path, reason in REMOVED_IN_DEEPSPEED.items():
        if path in IMPLEMENTED:
            continue
        block, _, key = path.rpartition(".")
        where = config if not block else zero if isinstance(zero, dict) else {}
        if key in where:
            found.append(f"{path}: {reason} (removed in DeepSpeed 0.19; remove the key)")
    if found:
        raise ConfigError("; ".join(found))


def refuse_unsupported(config: Any, given: set[str]) -> None:
    """Raise one ConfigError naming every user-set key (in ``given``) of a feature that is not implemented."""
    found: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(config):
        if f.name in given:
            found += _walk(f.name, getattr(config, f.name), _default(f), given)
    if found:
        raise ConfigError("; ".join(_describe(path, value, default, given) for path, value, default in found))


def _describe(path: str, value: Any, default: Any, given: set[str]) -> str:
    reason = next((_REASONS[p] for p in sorted(_REASONS, key=len, reverse=True) if path.startswith(p)), None)
    reason = reason or "not implemented"
    if dataclasses.is_dataclass(value):  # a whole block: name every key of it the user set
        keys = sorted(g for g in given if g.startswith(path + "."))
        setting = f" (it sets {', '.join(keys)})" if keys else ""
        return f"{path}: this block is not supported by shardspeed ({reason}); remove it{setting}"
    fix = "remove the key" if default is None else f"remove the key or set its default {show(default)}"
    return f"{path}: {show(value)} is not supported by shardspeed ({reason}); {fix}"


def _walk(path: str, value: Any, default: Any, given: set[str]) -> list[tuple[str, Any, Any]]:
    """The (path, value, default) of each key under ``path`` that is set, not implemented, and effective."""
    if path in IMPLEMENTED:
        return []
    if not dataclasses.is_dataclass(value):
        return [(path, value, default)] if value != default else []
    fields = dataclasses.fields(value)
    if any(f.name == "enabled" for f in fields):  # a switched block: nothing in it matters while it is off
        if not value.enabled:
            return []
        if f"{path}.enabled" not in IMPLEMENTED and not _partly_implemented(path):
            return [(path, value, default)]
    elif getattr(type(value), "ACTIVE_WHEN_PRESENT", False) and not _partly_implemented(path):
        return [(path, value, default)]
    found: list[tuple[str, Any, Any]] = []
    for f in fields:
        sub = f"{path}.{f.name}"
        if sub in given and f.name != "enabled":
            found += _walk(sub, getattr(value, f.name), _default(f), given)
    return found


def _partly_implemented(path: str) -> bool:
    return any(key.startswith(path + ".") for key in IMPLEMENTED)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
