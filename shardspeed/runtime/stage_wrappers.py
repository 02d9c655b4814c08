"""The stage's optimizer wrapper the engine drives: stage 0 (`DataParallelOptimizer`) or ZeRO 1-3, built from
the config's gradient, ZeRO, offload and precision keys.

`wrap_optimizer(engine, torch_optimizer)` is what `ShardspeedEngine` calls once at start; everything here
only reads the engine's config, plan, module and groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.config import ConfigError
from shardspeed.core import partitioned
from shardspeed.core.grad_buckets import BucketedAllReducer, bucket_layout, comm_dtype_of
from shardspeed.core.precision import make_scaler
from shardspeed.runtime.data_parallel import DataParallelOptimizer
from shardspeed.runtime.optim import is_zero_tested_optimizer
from shardspeed.zero.offload import OptimizerOffload
from shardspeed.zero.optimizer import zero_stage_1_2, zero_stage_3
from shardspeed.zero.swap import AioSettings
from shardspeed.zero.swap.param_swapper import build_param_tier

__all__ = ["wrap_optimizer"]


def wrap_optimizer(engine, optimizer: torch.optim.Optimizer):
    """The stage's wrapper around `engine`'s torch optimizer (one per reduction domain with MoE)."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    scaler = make_scaler(engine._config, engine.plan)
    if engine.moe is not None:  # one wrapper per reduction domain (dense, each expert group)
        wrap = lambda opt, sub, group, owned: _wrap_params(engine, opt, sub, group, scaler, owned)  # noqa: E731
        return engine.moe.wrap_optimizer(
            optimizer, named, wrap, scaler=scaler, clip=engine.gradient_clipping()
        )
    return _wrap_params(engine, optimizer, named, engine.dp_group, scaler)


def _wrap_params(engine, optimizer, named, group, scaler, owned: set[int] | None = None):
    """The stage's wrapper over the parameters `named`, reduced over `group` (stage 3: `owned` are the
    ids of the module parameters it partitions, frozen ones included; None for all)."""
    stage = engine.zero_optimization_stage()
    zero_cfg = engine._config.zero_optimization
    common = dict(plan=engine.plan, scaler=scaler, gradient_clipping=engine._config.gradient_clipping)
    comm = dict(
        group=group,
        prescale_gradients=engine._config.prescale_gradients,
        gradient_predivide_factor=engine._config.gradient_predivide_factor,
        average=engine._config.gradient_allreduce_op == "mean",
    )
    if stage == 0:  # (optimizer offload at stage 0 is refused by the config)
        by_comm_dtype = lambda p: comm_dtype_of(p, engine.plan.comm_dtype)  # noqa: E731
        layout = bucket_layout([[p for _, p in named]], int(zero_cfg.reduce_bucket_size), by_comm_dtype)
        reducer = BucketedAllReducer(
            [params for _, params in layout],
            accum_dtype=engine.plan.grad_accum_dtype,
            comm_dtype=engine.plan.comm_dtype,
            **comm,
        )
        return DataParallelOptimizer(optimizer, named, reducer=reducer, **common)
    _check_zero_optimizer(engine, optimizer)
    common["offload"] = _optimizer_offload(engine)
    comm["overlap_comm"] = bool(zero_cfg.overlap_comm)
    comm["use_reduce_scatter"] = bool(zero_cfg.reduce_scatter)
    # sub_group_size bounds the elements one optimizer step sees per rank: each bucket or unit is at most
    # sub_group_size elements per rank.
    sub_group_numel = int(zero_cfg.sub_group_size) * dist.get_world_size(group)
    if stage == 3:
        return zero_stage_3(
            engine.module,
            optimizer,
            named,
            allgather_sequential=zero_cfg.stage3_allgather_sequential,
            fetch_with_all_reduce=zero_cfg.stage3_use_all_reduce_for_fetch_params,
            log_order_changes=zero_cfg.log_trace_cache_warnings,
            owned=owned,
            unit_numel=_stage3_unit_numel(engine, sub_group_numel),
            persistence_threshold=int(zero_cfg.stage3_param_persistence_threshold),
            model_persistence_threshold=int(zero_cfg.stage3_model_persistence_threshold),
            prefetch_numel=int(zero_cfg.stage3_prefetch_bucket_size),
            max_live_numel=int(zero_cfg.stage3_max_live_parameters),
            max_reuse_distance=int(zero_cfg.stage3_max_reuse_distance),
            param_tier=build_param_tier(
                zero_cfg.offload_param,
                AioSettings.from_config(engine._config.aio),
                engine.module,
                engine.dp_group,
            ),
            zeropp=engine.zeropp,
            **common,
            **comm,
        )
    wrapper = zero_stage_1_2(
        optimizer,
        named,
        stage=stage,
        bucket_numel=min(int(zero_cfg.reduce_bucket_size), sub_group_numel),
        allgather_numel=int(zero_cfg.allgather_bucket_size),
        **common,
        **comm,
    )
    wrapper.compute_grad_norm = zero_cfg.compute_grad_norm
    return wrapper


def _optimizer_offload(engine) -> OptimizerOffload | None:
    block = engine._config.zero_optimization.offload_optimizer
    if block is None or block.device == "none":
        return None
    return OptimizerOffload(
        block.device, block.nvme_path, block.pin_memory, block.buffer_count, block.pipeline_read,
        block.pipeline_write, AioSettings.from_config(engine._config.aio),
    )  # fmt: skip


def _stage3_unit_numel(engine, sub_group_numel: int) -> int:
    """Largest unit gathered whole: the prefetch/bucket/sub-group sizes, and at most a quarter of the
    model, so that even a small model spans several units and gathers overlap the compute of earlier ones."""
    zero_cfg = engine._config.zero_optimization
    total = sum(partitioned.logical_numel(p) for p in {id(p): p for p in engine.module.parameters()}.values())
    limits = (zero_cfg.reduce_bucket_size, zero_cfg.stage3_prefetch_bucket_size, sub_group_numel)
    return int(min(*limits, max(1, total // 4)))


def _check_zero_optimizer(engine, optimizer: torch.optim.Optimizer) -> None:
    if is_zero_tested_optimizer(optimizer) or engine._config.zero_allow_untested_optimizer:
        return
    raise ConfigError(
        f"zero_allow_untested_optimizer: {type(optimizer).__name__} is not known to work with ZeRO, which "
        "steps flat shards instead of whole tensors (a per-tensor rule such as LAMB's trust ratio would "
        'apply per shard). Use Adam/AdamW/Adagrad/Lion, or set "zero_allow_untested_optimizer": true.'
    )
