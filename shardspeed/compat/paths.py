"""THE table of DeepSpeed import paths that are not where shardspeed keeps them, and where each one goes.

Keys are DeepSpeed paths relative to `deepspeed` (`"runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"`,
`"utils.safe_get_full_grad"`, `"initialize"`); a path that is the same in both packages (`zero.Init`,
`moe.layer.MoE`) needs no entry, since `deepspeed.X` is `shardspeed.X`. Values:

- `"shardspeed.pipe"`: that module itself, under the DeepSpeed name too (its submodules follow it);
- `"shardspeed.zero.api:safe_get_full_grad"`: that attribute;
- `"*"` keys: `"runtime.lr_schedules.*": "shardspeed.compat.mirrors.lr_schedule_keys"` adds that module's public names
  to the module at the path (names the real module lacks);
- `NotOffered(reason)`: a name shardspeed does not offer; it imports, and using it raises `NotOfferedError`
  saying why (`module=True`: a whole module and everything under it).

The finder (finder.py) applies the table to imports and to attribute access, for `import shardspeed as
deepspeed` users and, through the `deepspeed` alias, for `import deepspeed` users alike. tests/test_compat_paths.py
imports every entry. docs/compatibility.md ("Import paths") explains the groups below.
"""

from __future__ import annotations

from shardspeed.compat.not_offered import NotOffered
from shardspeed.compat.wheel_paths import INTERNAL as _INTERNAL
from shardspeed.compat.wheel_paths import KERNELS as _KERNELS
from shardspeed.compat.wheel_paths import add_wheel_paths

__all__ = ["PATHS"]

_DATA_ANALYZER = (
    "DeepSpeed's DataAnalyzer (the offline map-reduce of a metric over a dataset) is not built; compute the metric "
    "per sample and write the curriculum's index files with shardspeed.data_pipeline.write_metric_index"
)

_AUTOEP_FAMILY = (
    "AutoEP's presets are one registry here: deepspeed.module_inject.auto_ep_presets.registry.PRESET_MODELS "
    "(shardspeed.moe.autoep.presets), one entry per family"
)
_ROLLOUT_BACKEND = (
    "DeepSpeed's continuous-batching decode loop is not built; HybridEngineRollout generates with the engine's "
    "own generate, one batch per request"
)
_ROLLOUT_OPSD = "the on-policy distillation losses (generalized JSD over response tokens) are not built"

PATHS: dict[str, object] = {
    # -- top-level names (`deepspeed.X`) -----------------------------------------------------------------
    "initialize": "shardspeed.api:initialize",
    "add_config_arguments": "shardspeed.api:add_config_arguments",
    "DeepSpeedOptimizerCallable": "shardspeed.api:DeepSpeedOptimizerCallable",
    "DeepSpeedSchedulerCallable": "shardspeed.api:DeepSpeedSchedulerCallable",
    "init_distributed": "shardspeed.comm.init:init_distributed",
    "dist": "shardspeed.comm",
    "TORCH_DISTRIBUTED_DEFAULT_PORT": "shardspeed.comm.init:TORCH_DISTRIBUTED_DEFAULT_PORT",
    "constants.TORCH_DISTRIBUTED_DEFAULT_PORT": "shardspeed.comm.init:TORCH_DISTRIBUTED_DEFAULT_PORT",
    "DeepSpeedEngine": "shardspeed.runtime.engine:ShardspeedEngine",
    "ShardspeedEngine": "shardspeed.runtime.engine:ShardspeedEngine",
    "DeepSpeedConfig": "shardspeed.compat.mirrors.runtime_config:DeepSpeedConfig",
    "load_ds_config": "shardspeed.config.loader:read_config_source",
    "DeepSpeedConfigError": "shardspeed.config.errors:ConfigError",
    "ConfigError": "shardspeed.config.errors:ConfigError",
    "CheckpointError": "shardspeed.checkpoint.files:CheckpointError",
    "DeepSpeedDataLoader": "shardspeed.runtime.data:ShardedDataLoader",
    "RepeatingLoader": "shardspeed.runtime.data:RepeatingLoader",
    "DeepSpeedOptimizer": "shardspeed.core.optimizer_wrapper:OptimizerWrapper",
    "PipelineModule": "shardspeed.pipe.module:PipelineModule",
    "PipelineEngine": "shardspeed.runtime.pipeline_engine:PipelineEngine",
    "init_inference": "shardspeed.inference:init_inference",
    "default_inference_config": "shardspeed.inference:default_inference_config",
    "DeepSpeedInferenceConfig": "shardspeed.config.inference:InferenceConfig",
    "InferenceEngine": "shardspeed.inference.engine:InferenceEngine",
    "tp_model_init": "shardspeed.runtime.tensor_parallel:tp_model_init",
    # -- AutoTP's layer rules and Hugging Face tp_plans (shardspeed/module_inject) ------------------------------
    "module_inject.autotp_config.AutoTPPresets": NotOffered(
        "AutoTP presets are not offered (tensor_parallel.preset_model is refused); AutoTP's built-in names and "
        "a model's Hugging Face tp_plan place the same layers"
    ),
    "module_inject.autotp_config.merge_autotp_configs": NotOffered(
        "it merges AutoTP presets, which are not offered; give one partition_config"
    ),
    "module_inject.tp_plan_converter": "shardspeed.module_inject.tp_plan",
    "module_inject.auto_tp.AutoTP": "shardspeed.module_inject.autotp_replacer:AutoTP",
    "module_inject.auto_tp.AutoTPConfig": "shardspeed.module_inject.autotp_config:AutoTPConfig",
    "module_inject.auto_tp.PartitionType": "shardspeed.module_inject.autotp_config:PartitionType",
    "module_inject.auto_tp.TPLayerSpec": "shardspeed.module_inject.autotp_config:TPLayerSpec",
    "runtime.tensor_parallel.config._get_hf_tp_plan": "shardspeed.module_inject.tp_plan:hf_tp_plan",
    "module_inject.layers.collect_autotp_universal_checkpoint_info": (
        "shardspeed.module_inject.tp_state:universal_checkpoint_info"
    ),
    "module_inject.layers.GateUpPack_LinearLayer": "shardspeed.module_inject.layers:GateUpPackLinearLayer",
    "module_inject.layers._build_param_uc_restore_meta": (
        "shardspeed.module_inject.tp_uc_meta:build_param_uc_restore_meta"
    ),
    "module_inject.layers._get_param_uc_conversion_meta": (
        "shardspeed.module_inject.tp_uc_meta:param_uc_conversion_meta"
    ),
    "module_inject.layers._subparam_shard_widths": "shardspeed.module_inject.tp_uc_meta:subparam_shard_widths",
    "checkpoint.ds_to_universal._validate_autotp_conversion_support": (
        "shardspeed.checkpoint.to_universal:validate_autotp_conversion_support"
    ),
    "checkpoint.ds_to_universal._group_per_tp_shapes": "shardspeed.checkpoint.tp_slices:group_per_tp_shapes",
    "checkpoint.ds_to_universal.merge_tp_slices": "shardspeed.checkpoint.tp_slices:merge_tp_slices",
    "checkpoint.ds_to_universal._merge_zero_shards": "shardspeed.checkpoint.tp_slices:merge_zero_shards",
    "checkpoint.ds_to_universal._resolve_logical_shape": "shardspeed.checkpoint.tp_slices:resolve_logical_shape",
    "checkpoint.universal_checkpoint.SubparamShape": "shardspeed.checkpoint.tp_slices:SubparamShape",
    "checkpoint.universal_checkpoint._get_param_uc_restore_meta": (
        "shardspeed.checkpoint.tp_restore:param_uc_restore_meta"
    ),
    "checkpoint.universal_checkpoint._narrow_sub_params": "shardspeed.checkpoint.tp_restore:narrow_sub_params",
    "checkpoint.universal_checkpoint._resolve_autotp_partition": (
        "shardspeed.checkpoint.tp_restore:resolve_autotp_partition"
    ),
    "checkpoint.universal_checkpoint.load_hp_checkpoint_state": (
        "shardspeed.checkpoint.tp_restore:load_hp_checkpoint_state"
    ),
    "checkpoint.universal_checkpoint": NotOffered(
        "DeepSpeed's per-parameter universal-checkpoint loading internals; load_universal reads a universal "
        "folder by name at any world size, ZeRO stage and tensor degree (shardspeed/checkpoint/universal_folder.py)",
        True,
    ),
    "OnDevice": "shardspeed.utils.init_on_device:OnDevice",
    "get_accelerator": "shardspeed.accelerator:get_accelerator",
    "logger": "shardspeed.utils.logging:logger",
    "log_dist": "shardspeed.utils.logging:log_dist",
    "git_hash": "shardspeed.compat.mirrors.git_version_info:git_hash",
    "git_branch": "shardspeed.compat.mirrors.git_version_info:git_branch",
    "git_version_info": "shardspeed.compat.mirrors.git_version_info",
    "git_version_info_installed": "shardspeed.compat.mirrors.git_version_info",
    "DeepSpeedHybridEngine": "shardspeed.runtime.hybrid_engine:HybridEngine",
    "DeepSpeedTransformerLayer": NotOffered(_KERNELS),
    "DeepSpeedTransformerConfig": NotOffered(_KERNELS),
    "replace_transformer_layer": NotOffered(_KERNELS),
    "DualPipeVEngine": NotOffered("the DualPipeV pipeline schedule is not built (PipelineModule runs 1F1B)"),
    "DualPipeVModule": NotOffered("the DualPipeV pipeline schedule is not built (PipelineModule runs 1F1B)"),
    # -- deepspeed.autotuning (shardspeed/autotuning; DeepSpeed's module names where they differ) ---------------
    "autotuning.scheduler": "shardspeed.autotuning.experiments",
    "autotuning.utils": "shardspeed.autotuning.dicts",
    "autotuning.config": "shardspeed.compat.mirrors.autotuning_config",
    "autotuning.tuner.GridSearchTuner": "shardspeed.autotuning.search_order:GridSearchTuner",
    "autotuning.tuner.RandomTuner": "shardspeed.autotuning.search_order:RandomTuner",
    "autotuning.tuner.index_based_tuner": "shardspeed.autotuning.search_order",
    "autotuning.tuner.base_tuner": "shardspeed.autotuning.search_order",
    "autotuning.tuner.ModelBasedTuner": NotOffered(
        "the model-based tuner (an XGBoost cost model) is not built; tuner_type gridsearch or random"
    ),
    "autotuning.tuner.model_based_tuner": NotOffered(
        "the model-based tuner (an XGBoost cost model) is not built; tuner_type gridsearch or random", True
    ),
    "autotuning.tuner.cost_model": NotOffered(
        "the model-based tuner (an XGBoost cost model) is not built; tuner_type gridsearch or random", True
    ),
    "autotuning.tuner.utils": NotOffered(
        "the model-based tuner's feature encoding (index_to_feature, dict_to_feature, ...) is not built; the "
        "search's own helpers are shardspeed.autotuning.dicts (all_combinations, get_val_by_key, ...)",
        True,
    ),
    "elasticity": NotOffered(
        "elastic training was removed in DeepSpeed 0.19 (its wheel has no deepspeed.elasticity, and both refuse "
        "the `elasticity` block); set the batch sizes directly",
        True,
    ),
    "compile": NotOffered(
        "DeepCompile's graph passes are not built; engine.compile() runs torch.compile on the module", True
    ),
    "datastates": NotOffered("the DataStates asynchronous checkpoint engine is not built", True),
    "io": NotOffered(
        "DeepSpeed's FastFileWriter is not built; checkpoints use shardspeed's own writer", True
    ),
    "linear": NotOffered("OptimizedLinear / LoRA with quantized base weights is not built", True),
    "model_implementations": NotOffered(
        "the inference v2 (FastGen) model implementations are not built", True
    ),
    # -- deepspeed.accelerator ------------------------------------------------------------------------------
    "accelerator.DeepSpeedAccelerator": "shardspeed.accelerator.facade:DeviceAccelerator",
    "accelerator.abstract_accelerator.DeepSpeedAccelerator": "shardspeed.accelerator.facade:DeviceAccelerator",
    "accelerator.real_accelerator": "shardspeed.accelerator",
    # -- deepspeed.ops ----------------------------------------------------------------------------------------
    "ops.__compatible_ops__": "shardspeed.compat.mirrors.op_builder:COMPATIBLE_OPS",
    "ops.op_builder.builder.OpBuilder": "shardspeed.compat.mirrors.op_builder:OpBuilder",
    "ops.op_builder.all_ops.ALL_OPS": "shardspeed.compat.mirrors.op_builder:ALL_OPS",
    "env_report": "shardspeed.launcher.report",
    "env_report.cli_main": "shardspeed.launcher.report:main",
    "ops.transformer": NotOffered(_KERNELS, True),
    "ops.sparse_attention": NotOffered(_KERNELS, True),
    "ops.quantizer": NotOffered(_KERNELS, True),
    "ops.fp_quantizer": NotOffered(_KERNELS, True),
    "ops.random_ltd": NotOffered(_KERNELS, True),
    "ops.DeepSpeedTransformerLayer": NotOffered(_KERNELS),
    "ops.DeepSpeedTransformerConfig": NotOffered(_KERNELS),
    # -- deepspeed.utils -----------------------------------------------------------------------------------
    "utils.logger": "shardspeed.utils.logging:logger",
    "utils.log_dist": "shardspeed.utils.logging:log_dist",
    "utils.set_z3_leaf_modules": "shardspeed.utils.z3_leaf_module:set_z3_leaf_modules",
    "utils.unset_z3_leaf_modules": "shardspeed.utils.z3_leaf_module:unset_z3_leaf_modules",
    "utils.get_z3_leaf_modules": "shardspeed.utils.z3_leaf_module:get_z3_leaf_modules",
    "utils.RepeatingLoader": "shardspeed.runtime.data:RepeatingLoader",
    "utils.OnDevice": "shardspeed.utils.init_on_device:OnDevice",
    "utils.get_accelerator": "shardspeed.accelerator:get_accelerator",
    "utils.safe_get_full_fp32_param": "shardspeed.zero.api:safe_get_full_fp32_param",
    "utils.safe_set_full_fp32_param": "shardspeed.zero.api:safe_set_full_fp32_param",
    "utils.safe_get_full_grad": "shardspeed.zero.api:safe_get_full_grad",
    "utils.safe_get_full_optimizer_state": "shardspeed.zero.api:safe_get_full_optimizer_state",
    "utils.safe_set_full_grad": "shardspeed.zero.local_access:safe_set_full_grad",
    "utils.safe_update_full_grad_vectorized": "shardspeed.zero.local_access:safe_update_full_grad_vectorized",
    "utils.safe_set_full_optimizer_state": "shardspeed.zero.local_access:safe_set_full_optimizer_state",
    "utils.safe_get_local_grad": "shardspeed.zero.local_access:safe_get_local_grad",
    "utils.safe_set_local_grad": "shardspeed.zero.local_access:safe_set_local_grad",
    "utils.safe_get_local_fp32_param": "shardspeed.zero.local_access:safe_get_local_fp32_param",
    "utils.safe_set_local_fp32_param": "shardspeed.zero.local_access:safe_set_local_fp32_param",
    "utils.safe_get_local_optimizer_state": "shardspeed.zero.local_access:safe_get_local_optimizer_state",
    "utils.safe_set_local_optimizer_state": "shardspeed.zero.local_access:safe_set_local_optimizer_state",
    "utils.get_full_hp_param": "shardspeed.zero.api:safe_get_full_fp32_param",
    "utils.get_full_hp_grad": "shardspeed.zero.api:safe_get_full_grad",
    "utils.set_full_hp_param": "shardspeed.zero.api:safe_set_full_fp32_param",
    "utils.set_full_hp_grad": "shardspeed.zero.local_access:safe_set_full_grad",
    "utils.get_data_parallel_group": "shardspeed.compat.mirrors.utils_groups:get_data_parallel_group",
    "utils.get_data_parallel_rank": "shardspeed.compat.mirrors.utils_groups:get_data_parallel_rank",
    "utils.get_data_parallel_world_size": "shardspeed.compat.mirrors.utils_groups:get_data_parallel_world_size",
    "utils.get_model_parallel_group": "shardspeed.compat.mirrors.utils_groups:get_model_parallel_group",
    "utils.get_model_parallel_rank": "shardspeed.compat.mirrors.utils_groups:get_model_parallel_rank",
    "utils.get_model_parallel_world_size": "shardspeed.compat.mirrors.utils_groups:get_model_parallel_world_size",
    "utils.get_tensor_model_parallel_group": "shardspeed.compat.mirrors.utils_groups:get_tensor_model_parallel_group",
    "utils.get_tensor_model_parallel_rank": "shardspeed.compat.mirrors.utils_groups:get_tensor_model_parallel_rank",
    "utils.get_tensor_model_parallel_src_rank": "shardspeed.compat.mirrors.utils_groups:get_tensor_model_parallel_src_rank",
    "utils.get_tensor_model_parallel_world_size": "shardspeed.compat.mirrors.utils_groups:get_tensor_model_parallel_world_size",
    "utils.zero_to_fp32": "shardspeed.checkpoint.consolidate",
    "utils.comms_logging.CommsLogger": "shardspeed.comm.logger:CommsLogger",
    "utils.pin_memory": "shardspeed.accelerator.native_pinning",
    "utils.pin_memory_tracker": "shardspeed.accelerator.pinned_tracker",
    "utils.timer.trim_mean": "shardspeed.comm.logger:trim_mean",
    "utils.timer.ThroughputTimer": "shardspeed.runtime.throughput:ThroughputTimer",
    "utils.timer": NotOffered(
        "DeepSpeed's other timer classes are internal; the engine times its phases itself "
        "(wall_clock_breakdown) and its throughput with engine.tput_timer (ThroughputTimer)",
        True,
    ),
    "utils.link_hp_params": NotOffered(_INTERNAL),
    "utils.lazy_init_hp_params_optimizer_state": NotOffered(_INTERNAL),
    "utils.fragment_address": NotOffered(_INTERNAL),
    "utils.get_hp_fragment_mapping": NotOffered(_INTERNAL),
    "utils.map_to_flat_opt_states": NotOffered(_INTERNAL),
    "utils.tensor_fragment": NotOffered(_INTERNAL, True),
    "utils.mixed_precision_linkage": NotOffered(_INTERNAL, True),
    # -- DeepSpeed modules whose contents live elsewhere here: the module path is that module ---------------
    "runtime.config": "shardspeed.compat.mirrors.runtime_config",
    "runtime.utils": "shardspeed.compat.mirrors.runtime_utils",
    "runtime.comm.coalesced_collectives": "shardspeed.compat.mirrors.coalesced_collectives",
    "runtime.zero.partition_parameters": "shardspeed.compat.mirrors.zero_partition_parameters",
    "runtime.zero.offload_config": "shardspeed.zero.offload_kinds",
    "runtime.zero.offload_states": "shardspeed.zero.offload_states",
    "runtime.pipe.engine": "shardspeed.runtime.pipeline_engine",
    "ops.op_builder": "shardspeed.compat.mirrors.op_builder",
    "utils.groups": "shardspeed.compat.mirrors.utils_groups",
    "utils.torch": "shardspeed.compat.mirrors.utils_torch",
    "utils.numa": "shardspeed.compat.mirrors.utils_numa",
    "checkpoint.utils": "shardspeed.compat.mirrors.checkpoint_utils",
    "compression.config": "shardspeed.compat.mirrors.compression_config",
    "compression.utils": "shardspeed.compat.mirrors.compression_utils",
    "inference.config.DeepSpeedInferenceConfig": "shardspeed.config.inference:InferenceConfig",
    "inference.config.InferenceConfig": "shardspeed.config.inference:InferenceConfig",
    "inference.config.DeepSpeedTPConfig": "shardspeed.config.inference:InferenceTensorParallelConfig",
    "inference.config.InferenceCheckpointConfig": "shardspeed.config.inference:InferenceCheckpointConfig",
    "inference.config.load_inference_config": "shardspeed.config.inference:load_inference_config",
    # ALST (Arctic Long Sequence Training): shardspeed/sequence/
    "runtime.sequence_parallel.parallel_state_sp": "shardspeed.sequence.parallel_state",
    "runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF": "shardspeed.sequence.hf_attention:UlyssesSPAttentionHF",
    "runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter": "shardspeed.sequence.hf_data:UlyssesSPDataLoaderAdapter",
    "runtime.sequence_parallel.ulysses_sp.TiledMLP": "shardspeed.sequence.tiled:TiledMLP",
    "runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss": "shardspeed.sequence.tiled:TiledFusedLogitsLoss",
    "runtime.sequence_parallel.ulysses_sp.SequenceTiledCompute": "shardspeed.sequence.tiled:SequenceTiledCompute",
    "runtime.sequence_parallel.ulysses_sp.sequence_tiled_compute": "shardspeed.sequence.tiled:sequence_tiled_compute",
    "runtime.sequence_parallel.ulysses_sp.AutogradComputeMLP": "shardspeed.sequence.tiled:AutogradComputeMLP",
    # -- deepspeed.runtime: the engine's modules under DeepSpeed's names ------------------------------------
    "runtime.pipe": "shardspeed.pipe",
    "runtime.pipe.topology": "shardspeed.comm.topology",
    "runtime.pipe.dualpipev": NotOffered("the DualPipeV pipeline schedule is not built", True),
    "runtime.pipe.schedule.BufferOpInstruction": NotOffered(
        "the pipeline engine runs shardspeed's own instruction set (shardspeed/pipe/schedule.py); custom "
        "buffer instructions are not supported"
    ),
    "runtime.state_dict_factory": NotOffered(
        "Megatron state-dict loaders for inference are not built; init_inference loads safetensors/HF weights",
        True,
    ),
    "sequence.fpdt_layer": NotOffered("FPDT (chunked long-sequence attention) layers are not built", True),
    "runtime.activation_checkpointing.checkpointing": "shardspeed.checkpointing",
    "runtime.activation_checkpointing.offload_activations": "shardspeed.checkpointing.hidden_states_offload",
    "runtime.lr_schedules.*": "shardspeed.compat.mirrors.lr_schedule_keys",
    "runtime.dataloader.DeepSpeedDataLoader": "shardspeed.runtime.data:ShardedDataLoader",
    "runtime.dataloader.RepeatingLoader": "shardspeed.runtime.data:RepeatingLoader",
    "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3": "shardspeed.compat.mirrors.optimizer_classes:ZeroStage3Optimizer",
    "runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer": "shardspeed.compat.mirrors.optimizer_classes:ZeroStage12Optimizer",
    "runtime.zero.parameter_offload.DeepSpeedZeRoOffload": "shardspeed.compat.mirrors.optimizer_classes:ZeroParameterOffload",
    "zero.DeepSpeedZeRoOffload": "shardspeed.compat.mirrors.optimizer_classes:ZeroParameterOffload",
    "runtime.zero.parameter_offload.ZeROOrderedDict": "shardspeed.zero.parameter_dict:ZeROOrderedDict",
    "runtime.zero.parameter_offload.ensure_zero_ordered_dict": "shardspeed.zero.parameter_dict:ensure_zero_ordered_dict",
    "runtime.fp16.fused_optimizer.FP16_Optimizer": "shardspeed.compat.mirrors.optimizer_classes:FP16Optimizer",
    "runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer": "shardspeed.compat.mirrors.optimizer_classes:FP16UnfusedOptimizer",
    "runtime.bf16_optimizer.BF16_Optimizer": "shardspeed.compat.mirrors.optimizer_classes:BF16Optimizer",
    "runtime.zero.Init": "shardspeed.zero.init:Init",
    "runtime.zero.GatheredParameters": "shardspeed.zero.api:GatheredParameters",
    "runtime.zero.ZeroParamStatus": "shardspeed.core.partitioned:ZeroParamStatus",
    "runtime.zero.register_external_parameter": "shardspeed.zero.api:register_external_parameter",
    "runtime.zero.unwrap_model_for_generation": "shardspeed.zero.api:unwrap_model_for_generation",
    "runtime.zero.config.DeepSpeedZeroConfig": "shardspeed.compat.mirrors.zero_config:DeepSpeedZeroConfig",
    # ZenFlow (shardspeed.zero.zenflow, ops/zenflow_adam.py)
    "runtime.zero.config.ZenFlowConfig": "shardspeed.config.zero:ZenFlowConfig",
    "runtime.zenflow.zenflow_config.ZenFlowConfig": "shardspeed.config.zero:ZenFlowConfig",
    "runtime.zenflow.zenflow_utils._split_affinity": "shardspeed.zero.zenflow.affinity:split_affinity",
    "ops.adam.zenflow_torch_adam": "shardspeed.ops.zenflow_adam",
    "ops.adam.zenflow_cpu_adam": "shardspeed.ops.zenflow_adam",
    "ops.adam.ZenFlowCPUAdam": "shardspeed.ops.zenflow_adam:ZenFlowCPUAdam",
    "ops.adam.ZenFlowSelectiveAdamW": "shardspeed.ops.zenflow_adam:ZenFlowSelectiveAdamW",
    "ops.adam.ZenFlowSelectiveAdamW_stage3": "shardspeed.ops.zenflow_adam:ZenFlowSelectiveAdamW_stage3",
    "runtime.zero.config.DeepSpeedZeroOffloadParamConfig": "shardspeed.config.zero:OffloadParamConfig",
    "runtime.zero.config.DeepSpeedZeroOffloadOptimizerConfig": "shardspeed.config.zero:OffloadOptimizerConfig",
    "runtime.zero.config.ZeroStageEnum": "shardspeed.compat.mirrors.deepspeed_types:ZeroStageEnum",
    "runtime.zero.config.OffloadDeviceEnum": "shardspeed.zero.offload_kinds:OffloadDeviceEnum",
    "runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig": "shardspeed.config.zero:OffloadParamConfig",
    "runtime.zero.offload_config.DeepSpeedZeroOffloadOptimizerConfig": "shardspeed.config.zero:OffloadOptimizerConfig",
    "runtime.zero.leaf_module_config.DeepSpeedZeroLeafModuleConfig": "shardspeed.config.zero:LeafModuleConfig",
    "runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_CLASSES": "shardspeed.config.zero:DEFAULT_LEAF_MODULE_CLASSES",
    "runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_NAMES": "shardspeed.config.zero:DEFAULT_LEAF_MODULE_NAMES",
    "runtime.zero.leaf_module_config.DEFAULT_LEAF_MODULE_NAME_SUFFIXES": "shardspeed.config.zero:DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "runtime.keep_in_fp32.keep_in_fp32_pattern": "shardspeed.core.module_dtypes:keep_in_fp32_pattern",
    "runtime.zero.utils.ZeRORuntimeException": "shardspeed.compat.mirrors.deepspeed_types:ZeRORuntimeException",
    "runtime.zero.partition_parameters.MultipleAllGatherHandles": NotOffered(_INTERNAL),
    "runtime.zero.partition_parameters.AllGatherCoalescedHandle": NotOffered(_INTERNAL),
    "runtime.zero.tiling.TiledLinear": NotOffered("TiledLinear is not built (ZeRO-3 gathers whole units)"),
    "runtime.zero.TiledLinear": NotOffered("TiledLinear is not built (ZeRO-3 gathers whole units)"),
    "runtime.zero.mics.MiCS_Init": NotOffered("MiCS (hierarchical ZeRO-3 partitioning) is not built"),
    "zero.MiCS_Init": NotOffered("MiCS (hierarchical ZeRO-3 partitioning) is not built"),
    "zero.TiledLinear": NotOffered("TiledLinear is not built (ZeRO-3 gathers whole units)"),
    "runtime.config.*": "shardspeed.compat.mirrors.config_names",
    "runtime.constants.*": "shardspeed.compat.mirrors.config_names",
    "runtime.config.DeepSpeedConfig": "shardspeed.compat.mirrors.runtime_config:DeepSpeedConfig",
    "runtime.precision_config.get_bfloat16_config": "shardspeed.compat.mirrors.runtime_config:get_bfloat16_config",
    "runtime.precision_config.get_float16_config": "shardspeed.compat.mirrors.runtime_config:get_float16_config",
    "runtime.pipe.topology._prime_factors": "shardspeed.compat.mirrors.runtime_utils:prime_factors",
    "runtime.comm.coalesced_collectives.all_to_all_quant_reduce": NotOffered(
        "quantized all-to-all gradient reduction (ZeRO++ qgZ) is not built"
    ),
    "runtime.zero.partition_parameters._contradicting_single_rank_pg_error": (
        "shardspeed.zero.init:contradicting_single_rank_group_error"
    ),
    "runtime.zero.partition_parameters.partitioned_param_data_shape": (
        "shardspeed.compat.mirrors.zero_partition_parameters:partitioned_param_data_shape"
    ),
    "runtime.config.DeepSpeedConfigError": "shardspeed.config.errors:ConfigError",
    "runtime.config.ZeroStageEnum": "shardspeed.compat.mirrors.deepspeed_types:ZeroStageEnum",
    # DeepSpeed's pydantic config classes (pydantic imported only when one of them is): DeepSpeedConfigModel is
    # a base for other people's configs; the fp16/bf16 classes are views of shardspeed's own blocks
    "runtime.config_utils": "shardspeed.compat.mirrors.config_utils",
    "runtime.config_utils.DeepSpeedConfigModel": "shardspeed.compat.mirrors.config_model:DeepSpeedConfigModel",
    "runtime.zero.config.DeepSpeedConfigModel": "shardspeed.compat.mirrors.config_model:DeepSpeedConfigModel",
    "runtime.zero.config.pp_int": "shardspeed.compat.mirrors.config_utils:pp_int",
    "runtime.zero.config.get_scalar_param": "shardspeed.compat.mirrors.config_utils:get_scalar_param",
    "runtime.precision_config.DeepSpeedFP16Config": "shardspeed.compat.mirrors.precision_config:DeepSpeedFP16Config",
    "runtime.precision_config.DeepSpeedBF16Config": "shardspeed.compat.mirrors.precision_config:DeepSpeedBF16Config",
    "runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine": NotOffered(
        "checkpoint engines are not pluggable: shardspeed writes atomic, weights-only checkpoint files itself"
    ),
    "runtime.engine.DeepSpeedEngine": "shardspeed.runtime.engine:ShardspeedEngine",
    "runtime.base_optimizer.DeepSpeedOptimizer": "shardspeed.core.optimizer_wrapper:OptimizerWrapper",
    "runtime.base_optimizer.ZeROOptimizer": "shardspeed.zero.optimizer:ZeroOptimizer",
    "runtime.hybrid_engine.DeepSpeedHybridEngine": "shardspeed.runtime.hybrid_engine:HybridEngine",
    # -- deepspeed.runtime.rollout: the interface RL trainers generate through, and its hybrid-engine backend -----
    "runtime.rollout": "shardspeed.compat.mirrors.rollout",
    "runtime.rollout.base": "shardspeed.compat.mirrors.rollout",
    "runtime.rollout.HybridEngineRollout": "shardspeed.compat.mirrors.rollout_hybrid_engine:HybridEngineRollout",
    "runtime.rollout.build_rollout": "shardspeed.compat.mirrors.rollout_hybrid_engine:build_rollout",
    "runtime.rollout.hybrid_engine_rollout": "shardspeed.compat.mirrors.rollout_hybrid_engine",
    "runtime.rollout.continuous_batching": NotOffered(_ROLLOUT_BACKEND, True),
    "runtime.rollout.JSDLossOutput": NotOffered(_ROLLOUT_OPSD),
    "runtime.rollout.ResponseTokenBatch": NotOffered(_ROLLOUT_OPSD),
    "runtime.rollout.generalized_jsd_loss": NotOffered(_ROLLOUT_OPSD),
    "runtime.rollout.opsd": NotOffered(_ROLLOUT_OPSD, True),
    # -- deepspeed.runtime.data_pipeline: curriculum learning and random-LTD (shardspeed/data_pipeline) ---------
    "runtime.data_pipeline": "shardspeed.data_pipeline",
    "runtime.data_pipeline.constants": "shardspeed.compat.mirrors.data_pipeline_constants",
    "runtime.data_pipeline.config": NotOffered(
        "DeepSpeed's dict getters of the data_efficiency block; shardspeed parses the block in its one config "
        "system (shardspeed.config.data_efficiency; engine.data_efficiency_config() returns it typed)",
        True,
    ),
    "runtime.data_pipeline.data_sampling": "shardspeed.data_pipeline",
    "runtime.data_pipeline.data_sampling.data_sampler": "shardspeed.data_pipeline.sampler",
    "runtime.data_pipeline.data_sampling.utils.find_fit_int_dtype": (
        "shardspeed.data_pipeline.indexed_dataset:find_fit_int_dtype"
    ),
    "runtime.data_pipeline.data_sampling.utils.create_mmap_dataset_builder": (
        "shardspeed.data_pipeline.indexed_dataset:create_mmap_dataset_builder"
    ),
    "runtime.data_pipeline.data_sampling.utils.close_mmap_dataset_builder": (
        "shardspeed.data_pipeline.indexed_dataset:close_mmap_dataset_builder"
    ),
    "runtime.data_pipeline.data_sampling.utils.split_index": NotOffered(_DATA_ANALYZER),
    "runtime.data_pipeline.data_sampling.utils.split_dataset": NotOffered(_DATA_ANALYZER),
    "runtime.data_pipeline.data_sampling.data_analyzer": NotOffered(_DATA_ANALYZER, True),
    "runtime.data_pipeline.data_sampling.variable_batch_size_and_lr": NotOffered(
        "dynamic batching (data_efficiency.data_sampling.dynamic_batching) is not built", True
    ),
    "runtime.data_pipeline.data_routing": "shardspeed.data_pipeline.random_ltd",
    "runtime.data_pipeline.data_routing.basic_layer": "shardspeed.data_pipeline.random_ltd.layer",
    "runtime.data_pipeline.data_routing.helper": "shardspeed.data_pipeline.random_ltd.convert",
    "runtime.data_pipeline.data_routing.utils": NotOffered(
        "DeepSpeed's unused per-sample gather/scatter helpers; random-LTD layers move tokens with "
        "shardspeed.data_pipeline.random_ltd.tokens (torch.gather / scatter)",
        True,
    ),
    "ops.random_ltd.dropping_utils": "shardspeed.data_pipeline.random_ltd.tokens",
    "runtime.comm.compressed": NotOffered("1-bit compressed communication is not built", True),
    "runtime.fp16.onebit": NotOffered("1-bit Adam/LAMB optimizers are not built", True),
    "ops.aio.AsyncIOBuilder": "shardspeed.compat.mirrors.op_builder:AsyncIOBuilder",
    "moe.sharded_moe._route_slots": "shardspeed.moe.sparse_routes:route_slots",
    "moe.sharded_moe._sparse_encode": "shardspeed.moe.sparse_routes:sparse_encode",
    "moe.sharded_moe._sparse_decode": "shardspeed.moe.sparse_routes:sparse_decode",
    "moe.sharded_moe._AllToAll": "shardspeed.moe.comm:AllToAll",
    "utils.groups._get_expert_parallel_ranks": "shardspeed.moe.groups:expert_parallel_ranks",
    "utils.set_z3_leaf_modules_by_name": "shardspeed.utils.z3_leaf_module:set_z3_leaf_modules_by_name",
    "utils.set_z3_leaf_modules_by_suffix": "shardspeed.utils.z3_leaf_module:set_z3_leaf_modules_by_suffix",
    "monitor.csv_monitor.csvMonitor": "shardspeed.monitor.csv_monitor:CsvMonitor",
    "monitor.config.DeepSpeedMonitorConfig": "shardspeed.compat.mirrors.runtime_config:DeepSpeedMonitorConfig",
    "launcher.multinode_runner": "shardspeed.compat.mirrors.launcher_backends",
    "launcher.multinode_runner.MVAPICHRunner": NotOffered(
        "shardspeed's launcher has no MVAPICH backend; MVAPICH2's hydra runs with --launcher mpich (MPICHRunner)"
    ),
    "launcher.multinode_runner.MultiNodeRunner": "shardspeed.compat.mirrors.launcher_runner:MultiNodeRunner",
    # -- deepspeed.checkpoint --------------------------------------------------------------------------------
    "checkpoint.DeepSpeedCheckpoint": "shardspeed.compat.mirrors.deepspeed_checkpoint:DeepSpeedCheckpoint",
    "checkpoint.deepspeed_checkpoint": "shardspeed.compat.mirrors.deepspeed_checkpoint",
    "checkpoint.ds_to_universal": "shardspeed.checkpoint.to_universal",
    "checkpoint.constants": "shardspeed.compat.mirrors.checkpoint_constants",
    "checkpoint.*": "shardspeed.compat.mirrors.checkpoint_constants",
    "checkpoint.model_3d_desc": "shardspeed.compat.mirrors.reshape_3d:model_3d_desc",
    "checkpoint.get_model_3d_descriptor": "shardspeed.compat.mirrors.reshape_3d:get_model_3d_descriptor",
    "checkpoint.ZeROCheckpoint": "shardspeed.compat.mirrors.reshape_3d:ZeROCheckpoint",
    "checkpoint.reshape_3d_utils": "shardspeed.compat.mirrors.reshape_3d",
    "checkpoint.zero_checkpoint": "shardspeed.compat.mirrors.reshape_3d",
    "checkpoint.ds_to_universal._aggregate_autoep_zero12_metadata": NotOffered(
        "AutoEP checkpoints (their per-family ZeRO metadata) are not built; saving or loading a model with AutoEP "
        "layers is refused"
    ),
    "runtime.engine._checkpoint_parallel_metadata": NotOffered(
        "shardspeed's model-states files record no checkpoint_parallel_dimensions entry (the tensor layout is "
        "its own part, pipeline stages their layer files); get_model_3d_descriptor reads the degrees from the files"
    ),
    # -- process groups and communication -----------------------------------------------------------------
    "moe.mappings": NotOffered("expert tensor parallelism is not built", True),
    "moe.utils.MoE": "shardspeed.moe.layer:MoE",
    "moe.layer.log_dist": "shardspeed.utils.logging:log_dist",
    "comm.CommsLogger": "shardspeed.comm.logger:CommsLogger",
    "comm.get_accelerator": "shardspeed.accelerator:get_accelerator",
    "comm.inference_all_reduce": "shardspeed.comm.collectives:all_reduce",
    "comm.all_gather_object": "torch.distributed:all_gather_object",
    "comm.batch_isend_irecv": "torch.distributed:batch_isend_irecv",
    "comm.P2POp": "torch.distributed:P2POp",
    "comm.ProcessGroup": "torch.distributed:ProcessGroup",
    "comm.get_all_ranks_from_group": "torch.distributed:get_process_group_ranks",
    "utils.groups.get_accelerator": "shardspeed.accelerator:get_accelerator",
    "utils.groups.log_dist": "shardspeed.utils.logging:log_dist",
    "utils.set_z3_leaf_module": "shardspeed.utils.z3_leaf_module:set_z3_leaf_module",
    "utils.log_dist_once": "shardspeed.utils.logging:log_dist_once",
    "utils.set_log_level_from_string": "shardspeed.utils.logging:set_log_level_from_string",
    "utils.instrument_w_nvtx": "shardspeed.compat.mirrors.utils_torch:instrument_w_nvtx",
    "checkpointing.DeepSpeedConfig": "shardspeed.compat.mirrors.runtime_config:DeepSpeedConfig",
    "checkpointing.get_accelerator": "shardspeed.accelerator:get_accelerator",
    "checkpointing.see_memory_usage": "shardspeed.compat.mirrors.runtime_utils:see_memory_usage",
    "MUON_OPTIMIZER": "shardspeed.compat.mirrors.config_names:MUON_OPTIMIZER",
    "pipe.DualPipeVModule": NotOffered(
        "the DualPipeV pipeline schedule is not built (PipelineModule runs 1F1B)"
    ),
    # -- AutoEP (shardspeed.moe.autoep) ------------------------------------------------------------------
    "module_inject.auto_ep": "shardspeed.moe.autoep.detect",
    "module_inject.auto_ep._resolve_route_scale": "shardspeed.moe.autoep.detect:resolve_route_scale",
    "module_inject.auto_ep_config": "shardspeed.moe.autoep.config",
    "module_inject.auto_ep_config._UNSET": "shardspeed.moe.autoep.config:UNSET",
    "module_inject.auto_ep_config.validate_autoep_config": "shardspeed.moe.autoep.validate:validate_autoep_config",
    "module_inject.auto_ep_config.validate_autoep_post_detection": (
        "shardspeed.moe.autoep.validate:validate_autoep_post_detection"
    ),
    "module_inject.auto_ep_config.PRESET_MODELS": "shardspeed.moe.autoep.presets:PRESET_MODELS",
    "module_inject.auto_ep_config.available_preset_names": "shardspeed.moe.autoep.presets:available_preset_names",
    "module_inject.auto_ep_config.resolve_autoep_config_defaults": (
        "shardspeed.moe.autoep.presets:resolve_autoep_config_defaults"
    ),
    "module_inject.auto_ep_layer": "shardspeed.moe.autoep.layer",
    "module_inject.auto_ep_preset_adapters": "shardspeed.moe.autoep.presets",
    "module_inject.auto_ep_presets": "shardspeed.moe.autoep",
    "module_inject.auto_ep_presets.registry": "shardspeed.moe.autoep.presets",
    "module_inject.auto_ep_presets.base": "shardspeed.moe.autoep.config",
    "module_inject.auto_ep_presets.base._UNSET": "shardspeed.moe.autoep.config:UNSET",
    "module_inject.auto_ep_presets.base.AutoEPPresetAdapter": "shardspeed.moe.autoep.presets:AutoEPPresetAdapter",
    "module_inject.auto_ep_presets.base.GroupRoutingConfig": "shardspeed.moe.autoep.presets:GroupRoutingConfig",
    "moe.ep_router": "shardspeed.moe.autoep.router",
    "moe.ep_count": "shardspeed.moe.autoep.router",
    "moe.ep_experts": "shardspeed.moe.autoep.experts",
    "moe.ep_repack": "shardspeed.moe.autoep.repack",
    "moe.ep_kernels": "shardspeed.moe.autoep.token_permutation",
    "moe.fused_expert_layout": "shardspeed.moe.autoep.experts",
    # AutoEP folded onto AutoTP: the layout (folding.py), its gradient families (folding_grads.py), the dispatch
    "module_inject.auto_ep_folding": "shardspeed.moe.autoep.folding",
    "module_inject.auto_ep_folding.*": "shardspeed.moe.autoep.folding_grads",
    "moe.ep_tp_dispatch": "shardspeed.moe.autoep.ep_tp_dispatch",
    "module_inject.auto_ep_presets.deepseek_v2": NotOffered(_AUTOEP_FAMILY, True),
    "module_inject.auto_ep_presets.deepseek_v3": NotOffered(_AUTOEP_FAMILY, True),
    "module_inject.auto_ep_presets.mixtral": NotOffered(_AUTOEP_FAMILY, True),
    "module_inject.auto_ep_presets.qwen3_5_moe": NotOffered(_AUTOEP_FAMILY, True),
    "module_inject.auto_ep_presets.qwen3_moe": NotOffered(_AUTOEP_FAMILY, True),
    "module_inject.auto_ep_presets.minimax_m3": NotOffered(
        "the MiniMax-M3 AutoEP preset is not offered", True
    ),
    "checkpoint.autoep_universal": NotOffered(
        "the internals of DeepSpeed's universal conversion of AutoEP checkpoints (its per-rank fragment files); "
        "shardspeed's AutoEP checkpoints (per-expert files) load at another ep size, world size or ZeRO stage "
        "without conversion, and its ds_to_universal writes no fragment files",
        True,
    ),
}

add_wheel_paths(PATHS)  # every other module path of the 0.19.8 wheel, and the names DeepSpeed's tests import
