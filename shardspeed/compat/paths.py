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

__all__ = ["PATHS"]

_KERNELS = (
    "it is a compiled CUDA kernel; shardspeed compiles nothing (the model's own modules run as written)"
)
_INTERNAL = (
    "a DeepSpeed-internal helper with no counterpart in shardspeed's design; the public accessors "
    "(deepspeed.utils.safe_get_*/safe_set_*) and engine methods cover what users do with it"
)
_NOT_BUILT = "this feature is not built in shardspeed yet (docs/compatibility.md lists what is)"
_DATA_ANALYZER = (
    "DeepSpeed's DataAnalyzer (the offline map-reduce of a metric over a dataset) is not built; compute the metric "
    "per sample and write the curriculum's index files with shardspeed.data_pipeline.write_metric_index"
)

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
    "OnDevice": "shardspeed.utils.init_on_device:OnDevice",
    "get_accelerator": "shardspeed.accelerator:get_accelerator",
    "logger": "shardspeed.utils.logging:logger",
    "log_dist": "shardspeed.utils.logging:log_dist",
    "git_hash": "shardspeed.compat.mirrors.git_version_info:git_hash",
    "git_branch": "shardspeed.compat.mirrors.git_version_info:git_branch",
    "git_version_info": "shardspeed.compat.mirrors.git_version_info",
    "git_version_info_installed": "shardspeed.compat.mirrors.git_version_info",
    "DeepSpeedHybridEngine": NotOffered(
        "the hybrid engine (RLHF generate + train in one engine) is not built"
    ),
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
    "elasticity": NotOffered("elastic training (the `elasticity` block) is not built", True),
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
    "utils.pin_memory": NotOffered(
        "the native pinned-memory allocator is a compiled op; pinning uses torch's pin_memory()", True
    ),
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
    "runtime.lr_schedules.*": "shardspeed.compat.mirrors.lr_schedule_keys",
    "runtime.dataloader.DeepSpeedDataLoader": "shardspeed.runtime.data:ShardedDataLoader",
    "runtime.dataloader.RepeatingLoader": "shardspeed.runtime.data:RepeatingLoader",
    "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3": "shardspeed.compat.mirrors.optimizer_classes:ZeroStage3Optimizer",
    "runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer": "shardspeed.compat.mirrors.optimizer_classes:ZeroStage12Optimizer",
    "runtime.zero.parameter_offload.DeepSpeedZeRoOffload": "shardspeed.compat.mirrors.optimizer_classes:ZeroParameterOffload",
    "zero.DeepSpeedZeRoOffload": "shardspeed.compat.mirrors.optimizer_classes:ZeroParameterOffload",
    "runtime.fp16.fused_optimizer.FP16_Optimizer": "shardspeed.compat.mirrors.optimizer_classes:FP16Optimizer",
    "runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer": "shardspeed.compat.mirrors.optimizer_classes:FP16UnfusedOptimizer",
    "runtime.bf16_optimizer.BF16_Optimizer": "shardspeed.compat.mirrors.optimizer_classes:BF16Optimizer",
    "runtime.zero.Init": "shardspeed.zero.init:Init",
    "runtime.zero.GatheredParameters": "shardspeed.zero.api:GatheredParameters",
    "runtime.zero.ZeroParamStatus": "shardspeed.core.partitioned:ZeroParamStatus",
    "runtime.zero.register_external_parameter": "shardspeed.zero.api:register_external_parameter",
    "runtime.zero.unwrap_model_for_generation": "shardspeed.zero.api:unwrap_model_for_generation",
    "runtime.zero.config.DeepSpeedZeroConfig": "shardspeed.compat.mirrors.zero_config:DeepSpeedZeroConfig",
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
    "runtime.zero.partition_parameters.partitioned_param_data_shape": (
        "shardspeed.compat.mirrors.zero_partition_parameters:partitioned_param_data_shape"
    ),
    "runtime.config.DeepSpeedConfigError": "shardspeed.config.errors:ConfigError",
    "runtime.config.ZeroStageEnum": "shardspeed.compat.mirrors.deepspeed_types:ZeroStageEnum",
    "runtime.config_utils.DeepSpeedConfigModel": NotOffered(
        "DeepSpeed's pydantic config base class; shardspeed has one config system of dataclasses (shardspeed.config)"
    ),
    "runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine": NotOffered(
        "checkpoint engines are not pluggable: shardspeed writes atomic, weights-only checkpoint files itself"
    ),
    "runtime.engine.DeepSpeedEngine": "shardspeed.runtime.engine:ShardspeedEngine",
    "runtime.base_optimizer.DeepSpeedOptimizer": "shardspeed.core.optimizer_wrapper:OptimizerWrapper",
    "runtime.base_optimizer.ZeROOptimizer": "shardspeed.zero.optimizer:ZeroOptimizer",
    "runtime.hybrid_engine": NotOffered(
        "the hybrid engine (RLHF generate + train in one engine) is not built", True
    ),
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
    "launcher.multinode_runner": NotOffered(
        "DeepSpeed's runner classes are internal; shardspeed's launcher builds the same backends' commands "
        "(shardspeed/launcher/multinode.py) behind the same flags",
        True,
    ),
    # -- deepspeed.checkpoint --------------------------------------------------------------------------------
    "checkpoint.DeepSpeedCheckpoint": NotOffered(
        "the offline checkpoint reshaper is not needed: checkpoints load at any world size, stage and degree"
    ),
    "checkpoint.ds_to_universal": NotOffered(
        "no offline universal conversion is needed: checkpoints load at any world size, stage and degree",
        True,
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
}

# Every other module path of the DeepSpeed 0.19.8 wheel (tests/deepspeed_0_19_8_modules.txt), so that no
# program dies importing one: the module where shardspeed has it, else a stand-in module saying why.
_OPTIMIZER_MODULES = {  # DeepSpeed keeps each optimizer in a submodule; here each family is one module
    "ops.adam.cpu_adam": "shardspeed.ops.adam",
    "ops.adam.fused_adam": "shardspeed.ops.adam",
    "ops.adagrad.cpu_adagrad": "shardspeed.ops.adagrad",
    "ops.lion.cpu_lion": "shardspeed.ops.lion",
    "ops.lion.fused_lion": "shardspeed.ops.lion",
    "ops.lamb.fused_lamb": "shardspeed.ops.lamb",
    "comm.comm": "shardspeed.comm",  # `deepspeed.comm` is `from .comm import *` of this module
}
PATHS.update(_OPTIMIZER_MODULES)
# every builder module (per op, per accelerator) holds builder classes, all of which the one mirror defines
_OP_BUILDER_MODULES = (
    "async_io builder dc evoformer_attn fp_quantizer fused_adam fused_lamb fused_lion gds inference_core_ops "
    "inference_cutlass_builder pin_memory pin_memory_load quantizer ragged_ops ragged_utils random_ltd "
    "spatial_inference stochastic_transformer transformer transformer_inference utils "
    "cpu cpu.async_io cpu.builder cpu.comm cpu.cpu_adagrad cpu.cpu_adam cpu.cpu_lion cpu.fused_adam "
    "cpu.no_impl cpu.pin_memory "
    "hpu hpu.builder hpu.cpu_adam hpu.fp_quantizer hpu.fused_adam hpu.no_impl hpu.transformer_inference "
    "klxpu klxpu.async_io klxpu.builder klxpu.cpu_adagrad klxpu.cpu_adam klxpu.cpu_lion klxpu.fused_adam "
    "klxpu.no_impl klxpu.pin_memory klxpu.utils "
    "mlu mlu.builder mlu.cpu_adagrad mlu.cpu_adam mlu.fused_adam mlu.no_impl "
    "mps mps.builder mps.cpu_adam mps.fused_adam mps.no_impl "
    "npu npu.async_io npu.builder npu.cpu_adagrad npu.cpu_adam npu.cpu_lion npu.fused_adam npu.fused_lamb "
    "npu.fused_lion npu.inference npu.no_impl npu.pin_memory npu.quantizer "
    "sdaa sdaa.builder sdaa.cpu_adam sdaa.fused_adam sdaa.no_impl "
    "supa supa.async_io supa.builder supa.cpu_adagrad supa.cpu_adam supa.cpu_lion supa.fused_adam "
    "supa.fused_lamb supa.fused_lion supa.inference supa.no_impl supa.pin_memory supa.quantizer "
    "xpu xpu.async_io xpu.builder xpu.cpu_adagrad xpu.cpu_adam xpu.flash_attn xpu.fused_adam xpu.no_impl "
    "xpu.pin_memory"
)
for _module in _OP_BUILDER_MODULES.split():
    PATHS[f"ops.op_builder.{_module}"] = "shardspeed.compat.mirrors.op_builder"
_AUTOEP = "AutoEP (expert parallelism injected into Hugging Face MoE models) is not built; use deepspeed.moe.layer.MoE"
_INJECTION = (
    "DeepSpeed's kernel injection (its policies, containers and fused layers) is not built: init_inference runs "
    "the model's own modules, sharded by AutoTP"
)
_AUTOTP_INTERNAL = (
    "an internal of DeepSpeed's AutoTP; shardspeed's AutoTP (init_inference tensor_parallel, tp_model_init and "
    "the tensor_parallel config block) shards the model itself"
)
_OTHER_DEVICES = (
    "shardspeed has one accelerator class for CUDA and CPU (accelerator.DeepSpeedAccelerator); "
    "get_accelerator() returns it"
)
_COMM_BACKENDS = "DeepSpeed's communication backend classes; shardspeed.comm calls torch.distributed directly"
_STAND_IN_MODULES = {
    "accelerator.cpu_accelerator": _OTHER_DEVICES,
    "accelerator.cuda_accelerator": _OTHER_DEVICES,
    "accelerator.hpu_accelerator": _OTHER_DEVICES,
    "accelerator.klxpu_accelerator": _OTHER_DEVICES,
    "accelerator.mlu_accelerator": _OTHER_DEVICES,
    "accelerator.mps_accelerator": _OTHER_DEVICES,
    "accelerator.npu_accelerator": _OTHER_DEVICES,
    "accelerator.sdaa_accelerator": _OTHER_DEVICES,
    "accelerator.supa_accelerator": _OTHER_DEVICES,
    "accelerator.xpu_accelerator": _OTHER_DEVICES,
    "comm.backend": _COMM_BACKENDS,
    "comm.torch": _COMM_BACKENDS,
    "comm.ccl": _COMM_BACKENDS,
    "comm.mori": _COMM_BACKENDS,
    "comm.reduce_op": _COMM_BACKENDS,
    "comm.config": _INTERNAL,
    "comm.constants": _INTERNAL,
    "comm.utils": _INTERNAL,
    "comm.pg_utils": _INTERNAL,
    "inference.quantization": "DeepSpeed's int4/int8 weight-only inference quantization is not built",
    "inference.v2": "the inference v2 (FastGen) engine and its ragged kernels are not built; shardspeed.mii serves",
    "launcher.constants": _INTERNAL,
    "launcher.launcher_helper": "DeepSpeed's MPI launcher helper is not built; shardspeed's launcher starts ranks",
    "module_inject.auto_ep": _AUTOEP,
    "module_inject.auto_ep_comm": _AUTOEP,
    "module_inject.auto_ep_config": _AUTOEP,
    "module_inject.auto_ep_folding": _AUTOEP,
    "module_inject.auto_ep_layer": _AUTOEP,
    "module_inject.auto_ep_preset_adapters": _AUTOEP,
    "module_inject.auto_ep_presets": _AUTOEP,
    "moe.ep_count": _AUTOEP,
    "moe.ep_experts": _AUTOEP,
    "moe.ep_kernels": _AUTOEP,
    "moe.ep_repack": _AUTOEP,
    "moe.ep_router": _AUTOEP,
    "moe.ep_tp_dispatch": _AUTOEP,
    "moe.fused_expert_layout": _AUTOEP,
    "module_inject.containers": _INJECTION,
    "module_inject.inject": _INJECTION,
    "module_inject.load_checkpoint": _INJECTION,
    "module_inject.module_quantize": _INJECTION,
    "module_inject.policy": _INJECTION,
    "module_inject.replace_module": _INJECTION,
    "module_inject.replace_policy": _INJECTION,
    "module_inject.utils": _INJECTION,
    "module_inject.auto_tp_model_utils": _AUTOTP_INTERNAL,
    "module_inject.autotp_config": _AUTOTP_INTERNAL,
    "module_inject.fusedqkv_utils": _AUTOTP_INTERNAL,
    "module_inject.tp_plan_converter": _AUTOTP_INTERNAL,
    "module_inject.tp_shard": _AUTOTP_INTERNAL,
    "runtime.tensor_parallel.config": _AUTOTP_INTERNAL,
    "runtime.tensor_parallel.init_utils": _AUTOTP_INTERNAL,
    "runtime.tensor_parallel.tp_manager": _AUTOTP_INTERNAL,
    "monitor.utils": _INTERNAL,
    "nvme": "DeepSpeed's NVMe benchmark scripts are not built; `python -m shardspeed.tools.nvme_tune` measures "
    "the aio settings for the offload folder",
    "ops.adam.multi_tensor_apply": _KERNELS,
    "ops.lion.multi_tensor_apply": _KERNELS,
    "ops.adam.zenflow_cpu_adam": "ZenFlow is not built",
    "ops.adam.zenflow_torch_adam": "ZenFlow is not built",
    "ops.compile": "DeepCompile's graph passes are not built; engine.compile() runs torch.compile on the module",
    "ops.gds": _KERNELS,
    "ops.pin_memory": "the native pinned-memory allocator is a compiled op; pinning uses torch's pin_memory()",
    "ops.triton_ops": _KERNELS,
    "profiling.config": _INTERNAL,
    "profiling.constants": _INTERNAL,
    "runtime.activation_checkpointing.config": (
        "DeepSpeed's config class for activation checkpointing; shardspeed reads the block into its one config "
        "system (deepspeed.checkpointing.configure takes the same config)"
    ),
    "runtime.activation_checkpointing.offload_activations": "offloading hidden states to CPU memory between "
    "forward and backward is not built; use cpu_checkpointing in the activation_checkpointing block",
    "runtime.checkpoint_engine": "checkpoint engines are not pluggable: shardspeed writes atomic, weights-only "
    "checkpoint files itself",
    "runtime.model_checkpointing": "checkpoint writers are not pluggable: shardspeed writes atomic, "
    "weights-only checkpoint files itself",
    "runtime.chunked_cross_entropy": _NOT_BUILT,
    "runtime.domino": "Domino (tensor-parallel communication overlap) is not built",
    "runtime.hybrid_engine_graph": "the hybrid engine (RLHF generate + train in one engine) is not built",
    "runtime.rollout": "the hybrid engine's rollout API (RLHF generation) is not built",
    "runtime.fp16.loss_scaler": "DeepSpeed's loss-scaler classes are internal to its optimizers; the engine's "
    "optimizer scales the loss (engine.optimizer.cur_scale, the fp16 block configures it)",
    "runtime.sparse_tensor": "sparse embedding gradients (sparse_gradients) are not built",
    "runtime.superoffload": "SuperOffload is not built; ZeRO-3 offload_optimizer to cpu covers offloading",
    "runtime.swap_tensor": "DeepSpeed's NVMe swapper classes are internal; shardspeed swaps to NVMe itself "
    "(offload_param / offload_optimizer device nvme)",
    "runtime.torch_autocast": _INTERNAL,
    "runtime.weight_quantizer": "weight quantization on load is not built",
    "runtime.zenflow": "ZenFlow is not built",
    "runtime.zero.contiguous_memory_allocator": _INTERNAL,
    "runtime.zero.muon": "ZeRO's Muon optimizer (its sharded Newton-Schulz step) is not built",
    "runtime.zero.partitioned_param_coordinator": _INTERNAL,
    "runtime.zero.partitioned_param_profiler": _INTERNAL,
    "runtime.zero.test": _INTERNAL,
    "runtime.zero.linear": "LinearModuleForZeroStage3 / zero3_linear_wrap are not built: ZeRO-3 gathers a "
    "module's parameters around its forward and its backward, so torch's nn.Linear needs no wrapper",
    "sequence.auto_sp": "automatic sequence parallelism (AutoSP) is not built; see deepspeed.sequence.layer",
    "sequence.autosp_detector": "automatic sequence parallelism (AutoSP) is not built",
    "sequence.autosp_fusion": "automatic sequence parallelism (AutoSP) is not built",
    "sequence.autosp_vit": "automatic sequence parallelism (AutoSP) is not built",
    "sequence.test_autosp": "automatic sequence parallelism (AutoSP) is not built",
    "sequence.cross_entropy": "vocabulary-parallel cross-entropy for sequence parallelism is not built",
    "sequence.linear_cross_entropy": "vocabulary-parallel cross-entropy for sequence parallelism is not built",
    "sequence.vocab_parallel_ops": "vocabulary-parallel cross-entropy for sequence parallelism is not built",
    "utils.bwc": _INTERNAL,
    "utils.config": _INTERNAL,
    "utils.debug": _INTERNAL,
    "utils.exceptions": _INTERNAL,
    "utils.module_utils": _INTERNAL,
    "utils.nvtx": "NVTX ranges are not emitted; torch.profiler records the engine's phases",
    "utils.pin_memory_tracker": "pinned host memory is not tracked separately; torch allocates it",
    "utils.static_cache": _INTERNAL,
    "utils.types": _KERNELS,
    "utils.zero_to_torch": "use deepspeed.utils.zero_to_fp32 (its main() writes fp32 safetensors or "
    "pytorch_model.bin shards)",
}
for _path, _reason in _STAND_IN_MODULES.items():
    PATHS.setdefault(_path, NotOffered(_reason, True))
PATHS.update(
    {
        "runtime.zero.tiling.TiledLinearReturnBias": NotOffered(
            "TiledLinear is not built (ZeRO-3 gathers whole units)"
        ),
        "runtime.zero.partition_parameters.InsertPostInitMethodToModuleSubClasses": NotOffered(
            "zero.Init's DeepSpeed base class (it patches nn.Module constructors); use deepspeed.zero.Init itself"
        ),
        "runtime.zero.partition_parameters.CUDAQuantizer": NotOffered(
            "ZeRO++'s CUDA quantizer kernel; ZeRO++ here quantizes in PyTorch (shardspeed/zero/zeropp)"
        ),
        "sequence.layer.apply_rotary_pos_emb": "shardspeed.sequence.rotary:apply_rotary_pos_emb",
        "sequence.layer._rotate_half": "shardspeed.sequence.rotary:rotate_half",
        "sequence.layer._torchembed_available": "shardspeed.sequence.rotary:FUSED_ROPE_KERNEL",
    }
)
# Names DeepSpeed's own tests import from modules shardspeed does have, which it does not offer there
_NAMES_NOT_OFFERED = {
    "module_inject.auto_tp": ("AutoTP AutoTPConfig PartitionType TPLayerSpec", _AUTOTP_INTERNAL),
    "module_inject.layers": (
        "GateUpPack_LinearLayer LmHeadLinearAllreduce SubParamLinearAllreduce SubParamLinearLayer "
        "Yuan_LinearAllreduce Yuan_LinearLayer fused_LinearLayer collect_autotp_universal_checkpoint_info "
        "is_autotp_training_mode set_autotp_mode _build_param_uc_restore_meta _get_param_uc_conversion_meta "
        "_subparam_shard_widths",
        _AUTOTP_INTERNAL,
    ),
    "ops.op_builder": ("CUDAOpBuilder TorchCPUOpBuilder", _KERNELS),
    "runtime.zero.partition_parameters": (
        "get_allgather_dtype zero3_linear_wrap _contradicting_single_rank_pg_error",
        _INTERNAL,
    ),
    "runtime.zero.parameter_offload": ("ZeROOrderedDict ensure_zero_ordered_dict", _INTERNAL),
    "runtime.zero.offload_states": ("get_state_devices _make_offload_state_key", _INTERNAL),
    "runtime.utils": (
        "is_model_parallel_parameter register_output_backward_hooks count_used_parameters_in_backward "
        "CheckOverflow get_weight_norm",
        _INTERNAL,
    ),
    "sequence.layer": ("_SeqAllToAll", _INTERNAL),
    "runtime.precision_config": (
        "DeepSpeedFP16Config DeepSpeedBF16Config",
        "DeepSpeed's pydantic config classes; shardspeed checks the fp16/bf16 blocks in its one config system "
        "(runtime.precision_config.get_float16_config / get_bfloat16_config return them)",
    ),
    "inference.config": ("DeepSpeedMoEConfig", "MoE inference kernels are not built"),
}
for _module, (_names, _reason) in _NAMES_NOT_OFFERED.items():
    for _name in _names.split():
        PATHS.setdefault(f"{_module}.{_name}", NotOffered(_reason))

# DeepSpeed-internal names its public modules expose (helpers of its own implementation, or of features
# shardspeed does not build): importable stand-ins naming themselves when used. Grouped by module.
_INTERNAL_NAMES = {
    "": "KV MLA_KV MLA_Q NOT_HEAD_BLOCKED QUERY resolve_per_head_muon_after_sharding set_optimizer_flags "
    "merge_tp_model_init_into_config record_tp_model_init_args set_autotp_mode",
    "utils": "DeprecatedException bwc_pipeline_parallel_world_size bwc_tensor_model_parallel_world_size "
    "get_caller_func get_numactl_cmd initialize recursive_getattr recursive_setattr "
    "set_tensor_model_parallel_rank set_tensor_model_parallel_world_size z3_leaf_parameter",
    "utils.groups": "DeprecatedException bwc_pipeline_parallel_world_size bwc_tensor_model_parallel_world_size "
    "initialize set_tensor_model_parallel_rank set_tensor_model_parallel_world_size",
    "zero": "DeepSpeedTensorOverride TiledLinearReturnBias",
    "comm": "CCLBackend TorchBackend all_gather_coalesced all_reduce_coalesced allgather_fn "
    "enable_symm_mem_for_group get_caller_func get_comm_operation_count get_debug_log_name get_default_args "
    "get_local_rank_from_launcher get_logged_comm_ops get_msg_size_from_args get_tensor_kwarg "
    "get_tensor_position get_world_rank_from_launcher get_world_size_from_launcher has_all_gather_into_tensor "
    "has_all_reduce_coalesced has_coalescing_manager has_comm_data has_reduce_scatter_tensor in_aml in_aws_sm "
    "in_dlts init_deepspeed_backend initialize_mesh_device mpi_discovery "
    "patch_aml_env_for_torch_nccl_backend patch_aws_sm_env_for_torch_nccl_backend reduce_scatter_fn reset_log "
    "set_backend timed_op timers",
    "moe.utils": "configure_moe_param_groups",
    "checkpointing": "Timers bwc_tensor_model_parallel_rank copy_to_device detach_variable extract_tensors "
    "gather_partitioned_activations get_cpu_activations_for_backward get_offloaded_activations_for_backward "
    "get_partition_size get_partition_start get_partitioned_activations_for_backward "
    "is_activation_to_checkpoint merge_tensors model_parallel_reconfigure_tp_seed move_to_device "
    "partition_activations restore_offloaded_activations",
    "utils.zero_to_fp32": "GatheredTensor atoi natural_keys convert_zero_checkpoint_to_state_dict "
    "get_model_state_file parse_model_states parse_optim_states to_torch_tensor zero3_partitioned_param_info "
    "zero_model_state",
    "runtime.lr_schedules": "get_lr_from_config get_torch_optimizer override_1cycle_params "
    "override_lr_range_test_params override_params override_warmupCosineLR_params override_warmupLR_params "
    "parse_arguments update_lr",
    "runtime.zero.config": "DeepSpeedConfigModel DeepSpeedZeroLeafModuleConfig ZenFlowConfig get_scalar_param "
    "get_zero_config pp_int read_zero_config_deprecated",
    "ops.adam": "ZenFlowCPUAdam ZenFlowSelectiveAdamW ZenFlowSelectiveAdamW_stage3",
}
for _module, _names in _INTERNAL_NAMES.items():
    for _name in _names.split():
        PATHS.setdefault(f"{_module}.{_name}" if _module else _name, NotOffered(_INTERNAL))
