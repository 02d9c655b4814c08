"""DeepSpeed's engine getters: one-line questions to the config and the parallel layout.

Mixed into `ShardspeedEngine`. DeepSpeed's engine has about a hundred of these (`zero_offload_optimizer()`,
`optimizer_name()`, `get_data_parallel_rank()`, ...); scripts and integrations call them, so they are here
with DeepSpeed's names and return values, and nothing else. Two return what shardspeed measures instead of
the config value (listed in docs/compatibility.md): `loss_scale()` is the current scale and
`memory_breakdown()` the bytes per kind of state.
"""

from __future__ import annotations

import torch

from shardspeed.core.precision import DTYPES

__all__ = ["ConfigGetters"]

# DeepSpeed's own optimizer names, reported lower-case by `optimizer_name()` (runtime/config.py).
_DEEPSPEED_OPTIMIZERS = {"adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"}


def _zero_key(name: str, key: str | None = None):
    """A getter `name()` returning `zero_optimization.<key>` (default: `name` without its `zero_` prefix)."""
    key = key or name.removeprefix("zero_")

    def getter(self):
        return getattr(self._config.zero_optimization, key)

    getter.__name__, getter.__doc__ = name, f"`zero_optimization.{key}`"
    return getter


class ConfigGetters:
    """Getters DeepSpeed's `DeepSpeedEngine` offers; `self._config` is the `ShardspeedConfig`."""

    # -- parallel layout ---------------------------------------------------------------------------------

    @property
    def dp_world_size(self) -> int:
        """Ranks over which gradients are averaged (DeepSpeed's attribute)."""
        return self.world_size

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_model_parallel_rank(self) -> int:
        mpu = self.mpu
        return (
            mpu.get_model_parallel_rank()
            if mpu is not None and hasattr(mpu, "get_model_parallel_rank")
            else 0
        )

    get_tensor_parallel_rank = get_model_parallel_rank

    # -- optimizer and schedule ----------------------------------------------------------------------------

    def optimizer_name(self) -> str | None:
        """The class name of the optimizer passed to initialize() (or built by the callable passed; DeepSpeed
        reports "function" then), else the config's type (DeepSpeed's own names lower-cased, as it does)."""
        if self.client_optimizer is not None:
            return type(self.basic_optimizer).__name__
        if self._config.optimizer is None:
            return None
        name = self._config.optimizer.type
        return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name

    def optimizer_params(self) -> dict | None:
        return self._config.optimizer.params if self._config.optimizer is not None else None

    def optimizer_legacy_fusion(self) -> bool:
        return self._config.optimizer.legacy_fusion if self._config.optimizer is not None else False

    def scheduler_name(self) -> str | None:
        return self._config.scheduler.type if self._config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return self._config.scheduler.params if self._config.scheduler is not None else None

    # -- ZeRO ----------------------------------------------------------------------------------------------

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    is_first_weights_partition_group = zero_optimization_partition_weights

    def zero_offload_optimizer(self):
        """The `offload_optimizer` block, or None when the config has none (DeepSpeed returns the block)."""
        return self._config.zero_optimization.offload_optimizer

    def zero_offload_param(self):
        """The `offload_param` block, or None when the config has none."""
        return self._config.zero_optimization.offload_param

    def zero_use_cpu_optimizer(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device == "nvme"

    def zero_partial_offload(self) -> float:
        block = self.zero_offload_optimizer()
        return block.ratio if block is not None else 1.0

    def super_offload(self) -> bool:
        block = self.zero_offload_optimizer()
        return block.super_offload if block is not None else False

    def cpuadam_cores_perc(self) -> float:
        block = self.zero_offload_optimizer()
        return block.cpuadam_cores_perc if block is not None else 0.8

    def zenflow_config(self):
        return self._config.zero_optimization.zenflow

    def is_sanity_checks_enabled(self) -> bool:
        return self._config.zero_optimization.enable_sanity_checks

    zero_reduce_scatter = _zero_key("zero_reduce_scatter")
    zero_overlap_comm = _zero_key("zero_overlap_comm")
    zero_sub_group_size = _zero_key("zero_sub_group_size")
    zero_reduce_bucket_size = _zero_key("zero_reduce_bucket_size")
    zero_multi_rank_bucket_allreduce = _zero_key(
        "zero_multi_rank_bucket_allreduce", "use_multi_rank_bucket_allreduce"
    )
    zero_allgather_bucket_size = _zero_key("zero_allgather_bucket_size")
    zero_compute_grad_norm = _zero_key("zero_compute_grad_norm")
    zero_contiguous_gradients = _zero_key("zero_contiguous_gradients")
    zero_load_from_fp32_weights = _zero_key("zero_load_from_fp32_weights")
    zero_elastic_checkpoint = _zero_key("zero_elastic_checkpoint")
    zero_max_live_parameters = _zero_key("zero_max_live_parameters", "stage3_max_live_parameters")
    zero_max_reuse_distance = _zero_key("zero_max_reuse_distance", "stage3_max_reuse_distance")
    zero_prefetch_bucket_size = _zero_key("zero_prefetch_bucket_size", "stage3_prefetch_bucket_size")
    zero_module_granularity_threshold = _zero_key(
        "zero_module_granularity_threshold", "stage3_module_granularity_threshold"
    )
    zero_param_persistence_threshold = _zero_key(
        "zero_param_persistence_threshold", "stage3_param_persistence_threshold"
    )
    zero_model_persistence_threshold = _zero_key(
        "zero_model_persistence_threshold", "stage3_model_persistence_threshold"
    )
    zero_legacy_stage1 = _zero_key("zero_legacy_stage1")
    zero_ignore_unused_parameters = _zero_key("zero_ignore_unused_parameters")
    zero_save_muon_momentum_buffer_in_memory = _zero_key("zero_save_muon_momentum_buffer_in_memory")
    zero_allgather_partitions = _zero_key("zero_allgather_partitions")
    zero_round_robin_gradients = _zero_key("zero_round_robin_gradients")
    zero_parameter_alignment = _zero_key("zero_parameter_alignment")
    zero_hpz_partition_size = _zero_key("zero_hpz_partition_size", "zero_hpz_partition_size")
    zero_quantized_weights = _zero_key("zero_quantized_weights", "zero_quantized_weights")
    zero_quantized_nontrainable_weights = _zero_key(
        "zero_quantized_nontrainable_weights", "zero_quantized_nontrainable_weights"
    )
    zero_quantized_gradients = _zero_key("zero_quantized_gradients", "zero_quantized_gradients")
    zero_log_trace_cache_warnings = _zero_key("zero_log_trace_cache_warnings")
    zero_allgather_sequential = _zero_key("zero_allgather_sequential", "stage3_allgather_sequential")

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._config.zero_force_ds_cpu_optimizer

    # -- precision -----------------------------------------------------------------------------------------

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def fp16_auto_cast(self) -> bool:
        return self._config.fp16.auto_cast

    def fp16_master_weights_and_gradients(self) -> bool:
        return self._config.fp16.fp16_master_weights_and_grads

    def bf16_master_weights_and_gradients(self) -> bool:
        return self._config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self._config.bf16.bf16_optimizer_states

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return 2.0**self._config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict:
        fp16 = self._config.fp16
        return {
            "init_scale": 2.0**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": fp16.min_loss_scale,
        }

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        dtype = self._config.torch_autocast.dtype
        return DTYPES[dtype] if dtype is not None else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        from shardspeed.core.autocast import DEFAULT_SAFE_MODULES

        names = self._config.torch_autocast.lower_precision_safe_modules
        return list(DEFAULT_SAFE_MODULES) if names is None else list(names)

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are communicated in (DeepSpeed's property)."""
        return self.plan.comm_dtype

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient-accumulation dtype), as DeepSpeed reports them."""
        return self.plan.param_dtype, self.plan.grad_accum_dtype

    # -- the rest of the config ----------------------------------------------------------------------------

    def managed_gradient_accumulation(self) -> bool:
        return self._config.managed_gradient_accumulation

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def dump_state(self) -> bool:
        return self._config.dump_state

    def log_level(self) -> str | None:
        return self._config.log_level

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def aio_config(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self._config.aio)

    def tensor_parallel_config(self):
        return self._config.tensor_parallel

    def autotp_size(self) -> int:
        return self._config.tensor_parallel.autotp_size

    def use_node_local_storage(self) -> bool:
        return self._config.checkpoint.use_node_local_storage

    def load_universal_checkpoint(self) -> bool:
        return self._config.checkpoint.load_universal

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "Fail"

    def flops_profiler_enabled(self) -> bool:
        return self._config.flops_profiler.enabled
