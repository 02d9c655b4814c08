"""The table of FairScale import paths and where each one goes in shardspeed (the `fairscale` alias).

Keys are FairScale paths relative to `fairscale` (`"optim.oss.OSS"`); every proper prefix of a key is a
module of the alias (`fairscale.optim`, `fairscale.optim.oss`). Values, as in paths.py (DeepSpeed's table):

- `"shardspeed.fairscale.oss:OSS"`: that attribute;
- `NotOffered(reason)`: a FairScale name shardspeed does not offer: it imports, and using it raises
  `NotOfferedError` naming `fairscale.<path>` and saying why (`module=True`: everything under that module).

The alias package (integrations/fairscale-alias) applies the table; tests/test_fairscale_paths.py imports
every entry. docs/compatibility.md ("FairScale") explains what is offered and what differs.
"""

from __future__ import annotations

from shardspeed.compat.not_offered import NotOffered

__all__ = ["FAIRSCALE_PATHS", "FAIRSCALE_VERSION"]

FAIRSCALE_VERSION = "0.4.13"  # the release whose API the table follows

_OSS = "shardspeed.fairscale.oss:OSS"
_SDP = "shardspeed.fairscale.sharded_ddp:ShardedDataParallel"
_FSDP = "shardspeed.fairscale.fsdp:FullyShardedDataParallel"
_WRAP = "shardspeed.fairscale.wrap"
_CKPT = "shardspeed.fairscale.checkpoint_wrapper"
_OFFLOAD = "shardspeed.fairscale.offload_model:OffloadModel"
_PIPE = "shardspeed.fairscale.pipe:Pipe"
_FLATTEN = "shardspeed.fairscale.flatten_params:FlattenParamsWrapper"
_SCALER = (
    "FairScale's gradient scalers are not built: under ShardedDataParallel the gradients are shards that a "
    "GradScaler walking param.grad cannot see; train in bf16, or in fp32"
)
_ADASCALE = "shardspeed.fairscale.adascale"
_KERNEL = "it is a compiled CUDA kernel; shardspeed compiles nothing (use torch.optim's own implementation)"
_INTERNAL = "FairScale's internal and test helpers are not part of its user API"

FAIRSCALE_PATHS: dict[str, object] = {
    # -- optimizers ---------------------------------------------------------------------------------------
    "optim.OSS": _OSS,
    "optim.oss.OSS": _OSS,
    "optim.Adam": NotOffered(_KERNEL),
    "optim.adam.Adam": NotOffered(_KERNEL),
    "optim.Precision": NotOffered(_KERNEL),
    "optim.adam.Precision": NotOffered(_KERNEL),
    # -- data parallelism ----------------------------------------------------------------------------------
    "nn.ShardedDataParallel": _SDP,
    "nn.data_parallel.ShardedDataParallel": _SDP,
    "nn.data_parallel.sharded_ddp.ShardedDataParallel": _SDP,
    "nn.FullyShardedDataParallel": _FSDP,
    "nn.data_parallel.FullyShardedDataParallel": _FSDP,
    "nn.data_parallel.fully_sharded_data_parallel.FullyShardedDataParallel": _FSDP,
    **{
        f"{where}.{name}": f"shardspeed.fairscale.fsdp:{name}"
        for where in ("nn.data_parallel", "nn.data_parallel.fully_sharded_data_parallel")
        for name in ("TrainingState", "get_fsdp_instances")
    },
    # -- nested wrapping (`fairscale.nn.wrap` is the function there, and the module when imported) -----------
    **{
        f"{where}.{name}": f"{_WRAP}:{name}"
        for where in ("nn", "nn.wrap", "nn.wrap.auto_wrap")
        for name in (
            "auto_wrap",
            "config_auto_wrap_policy",
            "default_auto_wrap_policy",
            "enable_wrap",
            "wrap",
        )
    },
    # -- activation checkpointing, parameter offload, pipeline ----------------------------------------------
    **{
        f"{where}.{name}": f"{_CKPT}:{name}"
        for where in ("nn.checkpoint", "nn.checkpoint.checkpoint_activations")
        for name in ("checkpoint_wrapper", "disable_checkpointing", "is_checkpointing", "is_recomputing")
    },
    "nn.checkpoint_wrapper": f"{_CKPT}:checkpoint_wrapper",
    "nn.misc.checkpoint_wrapper": f"{_CKPT}:checkpoint_wrapper",
    "experimental.nn.offload.OffloadModel": _OFFLOAD,
    "nn.FlattenParamsWrapper": _FLATTEN,
    "nn.misc.FlattenParamsWrapper": _FLATTEN,
    "nn.misc.flatten_params_wrapper.FlattenParamsWrapper": _FLATTEN,
    "nn.Pipe": _PIPE,
    "nn.pipe.Pipe": _PIPE,
    "nn.pipe.pipe.Pipe": _PIPE,
    "optim.AdaScale": f"{_ADASCALE}:AdaScale",
    "optim.adascale.AdaScale": f"{_ADASCALE}:AdaScale",
    "optim.AdaScaleWrapper": f"{_ADASCALE}:AdaScaleWrapper",
    "optim.adascale.AdaScaleWrapper": f"{_ADASCALE}:AdaScaleWrapper",
    "optim.GradScaler": NotOffered(_SCALER),
    "optim.grad_scaler.GradScaler": NotOffered(_SCALER),
    "optim.grad_scaler.ShardedGradScaler": NotOffered(_SCALER),
    # -- FairScale parts with no counterpart here ----------------------------------------------------------
    "nn.MOELayer": NotOffered(
        "FairScale's MoE layer has its own gate and all-to-all; use shardspeed.moe.layer.MoE (DeepSpeed's)"
    ),
    "nn.Top2Gate": NotOffered("use shardspeed.moe.layer.MoE(k=2), DeepSpeed's top-2 gated MoE layer"),
    "nn.moe": NotOffered("use shardspeed.moe.layer.MoE (DeepSpeed's MoE layer)", module=True),
    "nn.model_parallel": NotOffered(
        "FairScale's Megatron-style layers are not built; shardspeed's tensor parallelism is AutoTP "
        "(shardspeed.tp_model_init / init_inference)",
        module=True,
    ),
    "nn.PipeRPCWrapper": NotOffered("RPC-driven pipelines are not built; Pipe runs on one process"),
    "nn.pipe.PipeRPCWrapper": NotOffered("RPC-driven pipelines are not built; Pipe runs on one process"),
    "nn.pipe.AsyncPipe": NotOffered("the asynchronous multi-process pipe is not built; use PipelineModule"),
    "nn.pipe.balance": NotOffered(
        "balancing by profiling is not built; give Pipe's balance (layers per partition) explicitly",
        module=True,
    ),
    "experimental.nn.data_parallel": NotOffered("gossip (SlowMo) data parallelism is not built", module=True),
    "experimental.nn.distributed_pipeline": NotOffered(
        "the RPC pipeline is not built; use shardspeed.pipe.PipelineModule", module=True
    ),
    "experimental.nn.ampnet_pipe": NotOffered("AMPNet's asynchronous pipeline is not built", module=True),
    "experimental.nn.auto_shard": NotOffered(
        "torch.fx-based automatic slicing is not built; OffloadModel slices an nn.Sequential by parameter count",
        module=True,
    ),
    "experimental.wgit": NotOffered("weigit (model version control) is not part of training", module=True),
    "internal": NotOffered(_INTERNAL, module=True),
    "utils": NotOffered(_INTERNAL, module=True),
    "fair_dev": NotOffered(_INTERNAL, module=True),
}
