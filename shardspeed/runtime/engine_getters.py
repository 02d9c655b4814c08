"""DeepSpeed's engine getters: one-line questions to the config and the parallel layout, and `settings`.

Mixed into `ShardspeedEngine`. `engine.settings` is the resolved config, typed (`ShardspeedConfig`): every
block as loaded, read-only by contract (only `set_train_batch_size` / `set_train_micro_batch_size` change
it, and only the batch triple). DeepSpeed's names for the config stay as DeepSpeed has them:
`engine.config` is the config dict as given (saved in checkpoints as `ds_config`), and `engine._config` is
the same object as `settings` (DeepSpeed's private name for its parsed config, which scripts read).

DeepSpeed's engine has about a hundred getters (`zero_offload_optimizer()`, `optimizer_name()`,
`get_data_parallel_rank()`, ...); scripts and integrations call them, so they are here with DeepSpeed's
names and return values, and nothing else. Those that return one config value are rows of
`CONFIG_GETTERS` (getter name -> dotted path into the config), generated as methods below the class; those
that compute something are written out. Two return what shardspeed measures instead of the config value
(listed in docs/compatibility.md): `loss_scale()` is the current scale and `memory_breakdown()` the bytes
per kind of state (both in engine.py).
"""

from __future__ import annotations

import dataclasses

import torch

from shardspeed.config import ShardspeedConfig
from shardspeed.core.precision import DTYPES

__all__ = ["CONFIG_GETTERS", "ConfigGetters"]

# DeepSpeed's own optimizer names, reported lower-case by `optimizer_name()` (runtime/config.py).
_DEEPSPEED_OPTIMIZERS = {"adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"}

_ZERO = "zero_optimization."
_OFFLOAD = _ZERO + "offload_optimizer."

# getter -> the config value it returns: a dotted path, or (path, value when a block on the way is absent)
CONFIG_GETTERS: dict[str, str | tuple[str, object]] = {
    # -- batch
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "managed_gradient_accumulation": "managed_gradient_accumulation",
    "dataloader_drop_last": "dataloader_drop_last",
    # -- optimizer and schedule
    "optimizer_params": ("optimizer.params", None),
    "optimizer_legacy_fusion": ("optimizer.legacy_fusion", False),
    "scheduler_name": ("scheduler.type", None),
    "scheduler_params": ("scheduler.params", None),
    # -- ZeRO; the offload blocks themselves (None when the config has none, DeepSpeed returns the block)
    "zero_optimization_stage": _ZERO + "stage",
    "zero_offload_optimizer": _ZERO + "offload_optimizer",
    "zero_offload_param": _ZERO + "offload_param",
    "zero_partial_offload": (_OFFLOAD + "ratio", 1.0),
    "super_offload": (_OFFLOAD + "super_offload", False),
    "cpuadam_cores_perc": (_OFFLOAD + "cpuadam_cores_perc", 0.8),
    "zenflow_config": _ZERO + "zenflow",
    "is_sanity_checks_enabled": _ZERO + "enable_sanity_checks",
    "zero_reduce_scatter": _ZERO + "reduce_scatter",
    "zero_overlap_comm": _ZERO + "overlap_comm",
    "zero_sub_group_size": _ZERO + "sub_group_size",
    "zero_reduce_bucket_size": _ZERO + "reduce_bucket_size",
    "zero_multi_rank_bucket_allreduce": _ZERO + "use_multi_rank_bucket_allreduce",
    "zero_allgather_bucket_size": _ZERO + "allgather_bucket_size",
    "zero_compute_grad_norm": _ZERO + "compute_grad_norm",
    "zero_contiguous_gradients": _ZERO + "contiguous_gradients",
    "zero_load_from_fp32_weights": _ZERO + "load_from_fp32_weights",
    "zero_elastic_checkpoint": _ZERO + "elastic_checkpoint",
    "zero_max_live_parameters": _ZERO + "stage3_max_live_parameters",
    "zero_max_reuse_distance": _ZERO + "stage3_max_reuse_distance",
    "zero_prefetch_bucket_size": _ZERO + "stage3_prefetch_bucket_size",
    "zero_module_granularity_threshold": _ZERO + "stage3_module_granularity_threshold",
    "zero_param_persistence_threshold": _ZERO + "stage3_param_persistence_threshold",
    "zero_model_persistence_threshold": _ZERO + "stage3_model_persistence_threshold",
    "zero_legacy_stage1": _ZERO + "legacy_stage1",
    "zero_ignore_unused_parameters": _ZERO + "ignore_unused_parameters",
    "zero_save_muon_momentum_buffer_in_memory": _ZERO + "save_muon_momentum_buffer_in_memory",
    "zero_allgather_partitions": _ZERO + "allgather_partitions",
    "zero_round_robin_gradients": _ZERO + "round_robin_gradients",
    "zero_parameter_alignment": _ZERO + "parameter_alignment",
    "zero_hpz_partition_size": _ZERO + "zero_hpz_partition_size",
    "zero_quantized_weights": _ZERO + "zero_quantized_weights",
    "zero_quantized_nontrainable_weights": _ZERO + "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients": _ZERO + "zero_quantized_gradients",
    "zero_log_trace_cache_warnings": _ZERO + "log_trace_cache_warnings",
    "zero_allgather_sequential": _ZERO + "stage3_allgather_sequential",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
    # -- precision and gradients
    "fp16_enabled": "fp16.enabled",
    "bfloat16_enabled": "bf16.enabled",
    "fp16_auto_cast": "fp16.auto_cast",
    "fp16_master_weights_and_gradients": "fp16.fp16_master_weights_and_grads",
    "bf16_master_weights_and_gradients": "bf16.bf16_master_weights_and_grads",
    "bf16_optimizer_states": "bf16.bf16_optimizer_states",
    "torch_autocast_enabled": "torch_autocast.enabled",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "gradient_clipping": "gradient_clipping",
    # -- the rest of the config
    "steps_per_print": "steps_per_print",
    "wall_clock_breakdown": "wall_clock_breakdown",
    "dump_state": "dump_state",
    "log_level": "log_level",
    "tensor_parallel_config": "tensor_parallel",
    "autotp_size": "tensor_parallel.autotp_size",
    "use_node_local_storage": "checkpoint.use_node_local_storage",
    "load_universal_checkpoint": "checkpoint.load_universal",
    "flops_profiler_enabled": "flops_profiler.enabled",
}


class ConfigGetters:
    """Getters DeepSpeed's `DeepSpeedEngine` offers; `self._config` is the `ShardspeedConfig`. The rows of
    `CONFIG_GETTERS` are added below the class."""

    @property
    def settings(self) -> ShardspeedConfig:
        """The resolved config, typed: read it, do not change it (see the module's docstring)."""
        return self._config

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

    # -- computed from the config ------------------------------------------------------------------------

    def optimizer_name(self) -> str | None:
        """The class name of the optimizer passed to initialize() (or built by the callable passed; DeepSpeed
        reports "function" then), else the config's type (DeepSpeed's own names lower-cased, as it does)."""
        if self.client_optimizer is not None:
            return type(self.basic_optimizer).__name__
        if self._config.optimizer is None:
            return None
        name = self._config.optimizer.type
        return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    is_first_weights_partition_group = zero_optimization_partition_weights

    def zero_use_cpu_optimizer(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device == "nvme"

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

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient-accumulation dtype), as DeepSpeed reports them."""
        return self.plan.param_dtype, self.plan.grad_accum_dtype

    def aio_config(self) -> dict:
        return dataclasses.asdict(self._config.aio)

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "Fail"


def _config_getter(name: str, path: str, absent: object = None):
    """The method `name()` returning the config value at `path` (`absent` when a block on the way is None)."""
    keys = path.split(".")

    def getter(self):
        value = self._config
        for key in keys:
            if value is None:
                return absent
            value = getattr(value, key)
        return value

    getter.__name__ = name
    getter.__qualname__ = f"ConfigGetters.{name}"
    getter.__doc__ = f"The config's `{path}`."
    return getter


for _name, _row in CONFIG_GETTERS.items():
    _path, _absent = (_row, None) if isinstance(_row, str) else _row
    setattr(ConfigGetters, _name, _config_getter(_name, _path, _absent))
del _name, _row, _path, _absent
