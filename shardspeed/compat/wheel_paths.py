"""The rest of THE table (paths.py): every other module path of the DeepSpeed 0.19.8 wheel
(tests/deepspeed_0_19_8_modules.txt), so that no program dies importing one — the module where shardspeed
has it, else a stand-in module saying why — and internal names DeepSpeed's own tests import.

paths.py calls `add_wheel_paths(PATHS)` once, after its own entries: an entry paths.py already has wins
(`setdefault`), except the optimizer submodules and the few names below that replace a module's stand-in.
"""

from __future__ import annotations

from shardspeed.compat.not_offered import NotOffered

__all__ = ["INTERNAL", "KERNELS", "NOT_BUILT", "add_wheel_paths"]

NOT_BUILT = "this feature is not built in shardspeed yet (docs/compatibility.md lists what is)"
KERNELS = "it is a compiled CUDA kernel; shardspeed compiles nothing (the model's own modules run as written)"
INTERNAL = (
    "a DeepSpeed-internal helper with no counterpart in shardspeed's design; the public accessors "
    "(deepspeed.utils.safe_get_*/safe_set_*) and engine methods cover what users do with it"
)
_ZENFLOW_INTERNAL = (
    "DeepSpeed's engine and optimizer glue for ZenFlow; shardspeed's ZenFlow is ZeRO's own optimizer "
    "(shardspeed.zero.zenflow), configured by zero_optimization.zenflow"
)
_OPTIMIZER_MODULES = {  # DeepSpeed keeps each optimizer in a submodule; here each family is one module
    "ops.adam.cpu_adam": "shardspeed.ops.adam",
    "ops.adam.fused_adam": "shardspeed.ops.adam",
    "ops.adagrad.cpu_adagrad": "shardspeed.ops.adagrad",
    "ops.lion.cpu_lion": "shardspeed.ops.lion",
    "ops.lion.fused_lion": "shardspeed.ops.lion",
    "ops.lamb.fused_lamb": "shardspeed.ops.lamb",
    "comm.comm": "shardspeed.comm",  # `deepspeed.comm` is `from .comm import *` of this module
}
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
_AUTOEP = "an AutoEP internal that is not built (DeepEP exchange, Triton kernels); see docs/compatibility.md"
_INJECTION = (
    "DeepSpeed's kernel injection (its policies, containers and fused layers) is not built: init_inference runs "
    "the model's own modules, sharded by AutoTP"
)
_AUTOTP_INTERNAL = (
    "an internal of DeepSpeed's AutoTP; shardspeed's AutoTP (init_inference tensor_parallel, tp_model_init and "
    "the tensor_parallel config block) shards the model itself"
)
_COMM_BACKENDS = "DeepSpeed's communication backend classes; shardspeed.comm calls torch.distributed directly"
_STAND_IN_MODULES = {
    "comm.backend": _COMM_BACKENDS,
    "comm.torch": _COMM_BACKENDS,
    "comm.ccl": _COMM_BACKENDS,
    "comm.mori": _COMM_BACKENDS,
    "comm.reduce_op": _COMM_BACKENDS,
    "comm.config": INTERNAL,
    "comm.constants": INTERNAL,
    "comm.utils": INTERNAL,
    "comm.pg_utils": INTERNAL,
    "inference.quantization": "DeepSpeed's int4/int8 weight-only inference quantization is not built",
    "inference.v2": "the inference v2 (FastGen) engine and its ragged kernels are not built; shardspeed.mii serves",
    "launcher.constants": INTERNAL,
    "launcher.launcher_helper": "DeepSpeed's MPI launcher helper is not built; shardspeed's launcher starts ranks",
    "module_inject.auto_ep_comm": _AUTOEP,
    "moe.ep_kernels": _AUTOEP,
    "module_inject.containers": _INJECTION,
    "module_inject.inject": _INJECTION,
    "module_inject.load_checkpoint": _INJECTION,
    "module_inject.module_quantize": _INJECTION,
    "module_inject.policy": _INJECTION,
    "module_inject.replace_module": _INJECTION,
    "module_inject.replace_policy": _INJECTION,
    "module_inject.utils": _INJECTION,
    "module_inject.auto_tp_model_utils": _AUTOTP_INTERNAL,
    "module_inject.fusedqkv_utils": _AUTOTP_INTERNAL,
    "module_inject.tp_shard": _AUTOTP_INTERNAL,
    "runtime.tensor_parallel.config": _AUTOTP_INTERNAL,
    "runtime.tensor_parallel.init_utils": _AUTOTP_INTERNAL,
    "runtime.tensor_parallel.tp_manager": _AUTOTP_INTERNAL,
    "monitor.utils": INTERNAL,
    "nvme": "DeepSpeed's NVMe benchmark scripts are not built; `python -m shardspeed.tools.nvme_tune` measures "
    "the aio settings for the offload folder",
    "ops.adam.multi_tensor_apply": KERNELS,
    "ops.lion.multi_tensor_apply": KERNELS,
    "ops.compile": "DeepCompile's graph passes are not built; engine.compile() runs torch.compile on the module",
    "ops.gds": KERNELS,
    "ops.pin_memory": "the native pinned-memory allocator is a compiled op; pinning uses torch's pin_memory()",
    "ops.triton_ops": KERNELS,
    "profiling.config": INTERNAL,
    "profiling.constants": INTERNAL,
    "runtime.activation_checkpointing.config": (
        "DeepSpeed's config class for activation checkpointing; shardspeed reads the block into its one config "
        "system (deepspeed.checkpointing.configure takes the same config)"
    ),
    "runtime.checkpoint_engine": "checkpoint engines are not pluggable: shardspeed writes atomic, weights-only "
    "checkpoint files itself",
    "runtime.model_checkpointing": "checkpoint writers are not pluggable: shardspeed writes atomic, "
    "weights-only checkpoint files itself",
    "runtime.chunked_cross_entropy": NOT_BUILT,
    "runtime.domino": "Domino (tensor-parallel communication overlap) is not built",
    "runtime.hybrid_engine_graph": "the CUDA-graph variant of the hybrid engine is not built; runtime.hybrid_engine is",
    "runtime.fp16.loss_scaler": "DeepSpeed's loss-scaler classes are internal to its optimizers; the engine's "
    "optimizer scales the loss (engine.optimizer.cur_scale, the fp16 block configures it)",
    "runtime.sparse_tensor": "sparse embedding gradients (sparse_gradients) are not built",
    "runtime.superoffload": "SuperOffload is not built; ZeRO-3 offload_optimizer to cpu covers offloading",
    "runtime.swap_tensor": "DeepSpeed's NVMe swapper classes are internal; shardspeed swaps to NVMe itself "
    "(offload_param / offload_optimizer device nvme)",
    "runtime.torch_autocast": INTERNAL,
    "runtime.weight_quantizer": "weight quantization on load is not built",
    "runtime.zenflow.engine": _ZENFLOW_INTERNAL,
    "runtime.zenflow.engine_stage3": "ZenFlow at ZeRO stage 3 is not built (stages 1 and 2 are)",
    "runtime.zenflow.zenflow_stage_1_and_2": _ZENFLOW_INTERNAL,
    "runtime.zero.contiguous_memory_allocator": INTERNAL,
    "runtime.zero.muon": "ZeRO's Muon optimizer (its sharded Newton-Schulz step) is not built",
    "runtime.zero.partitioned_param_coordinator": INTERNAL,
    "runtime.zero.partitioned_param_profiler": INTERNAL,
    "runtime.zero.test": INTERNAL,
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
    "utils.bwc": INTERNAL,
    "utils.config": INTERNAL,
    "utils.debug": INTERNAL,
    "utils.exceptions": INTERNAL,
    "utils.module_utils": INTERNAL,
    "utils.nvtx": "NVTX ranges are not emitted; torch.profiler records the engine's phases",
    "utils.static_cache": INTERNAL,
    "utils.types": KERNELS,
    "utils.zero_to_torch": "use deepspeed.utils.zero_to_fp32 (its main() writes fp32 safetensors or "
    "pytorch_model.bin shards)",
}
# names that replace what a stand-in module would give
_REAL_OR_REFUSED_NAMES = {
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
# Names DeepSpeed's own tests import from modules shardspeed does have, which it does not offer there
_NAMES_NOT_OFFERED = {
    "runtime.zenflow.zenflow_utils": (
        "_flatten_dense_tensors _unflatten_dense_tensors disable_accelerator all_tensors_equal "
        "_compute_zf_pt_affinity zenflow_optimizer_process start_optimizer_process "
        "ZENFLOW_OPTIMIZER_WAIT_POLL_SECONDS",
        "ZenFlow's overlapped variant (its optimizer process) is not built",
    ),
    "module_inject.layers": (
        "LmHeadLinearAllreduce SubParamLinearAllreduce "
        "Yuan_LinearAllreduce Yuan_LinearLayer fused_LinearLayer "
        "is_autotp_training_mode set_autotp_mode",
        _AUTOTP_INTERNAL,
    ),
    "ops.op_builder": ("CUDAOpBuilder TorchCPUOpBuilder", KERNELS),
    "runtime.zero.partition_parameters": (
        "get_allgather_dtype zero3_linear_wrap",
        INTERNAL,
    ),
    "runtime.zero.offload_states": ("get_state_devices _make_offload_state_key", INTERNAL),
    "runtime.utils": ("register_output_backward_hooks", INTERNAL),
    "sequence.layer": ("_SeqAllToAll", INTERNAL),
    "inference.config": ("DeepSpeedMoEConfig", "MoE inference kernels are not built"),
}

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
}


def add_wheel_paths(paths: dict) -> None:
    """Add the entries above to THE table `paths`, keeping what it already says (see the module docstring)."""
    paths.update(_OPTIMIZER_MODULES)
    for module in _OP_BUILDER_MODULES.split():
        paths[f"ops.op_builder.{module}"] = "shardspeed.compat.mirrors.op_builder"
    for path, reason in _STAND_IN_MODULES.items():
        paths.setdefault(path, NotOffered(reason, True))
    paths.update(_REAL_OR_REFUSED_NAMES)
    for module, (names, reason) in _NAMES_NOT_OFFERED.items():
        for name in names.split():
            paths.setdefault(f"{module}.{name}", NotOffered(reason))
    for module, names in _INTERNAL_NAMES.items():
        for name in names.split():
            paths.setdefault(f"{module}.{name}" if module else name, NotOffered(INTERNAL))
