"""The stage's optimizer wrapper the engine drives: stage 0 (`DataParallelOptimizer`) or ZeRO 1-3, built from
the config's gradient, ZeRO, offload and precision keys.

`StageSettings` is the typed part of the config these wrappers read: the `zero_optimization`, `fp16` (the
loss scaler) and `aio` blocks, and the top-level gradient keys. `wrap_optimizer(module, optimizer, settings,
plan=..., group=...)` is what `ShardspeedEngine` calls once at start; nothing here sees the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspeed.config import ConfigError
from shardspeed.config.blocks import Fp16Config
from shardspeed.config.features import AioConfig
from shardspeed.config.zero import ZeroConfig
from shardspeed.core.grad_buckets import BucketedAllReducer, bucket_layout, comm_dtype_of
from shardspeed.core.precision import PrecisionPlan, make_scaler
from shardspeed.runtime.data_parallel import DataParallelOptimizer
from shardspeed.runtime.optim import is_zero_tested_optimizer
from shardspeed.zero.offload import OptimizerOffload
from shardspeed.zero.optimizer import zero_stage_1_2, zero_stage_3
from shardspeed.zero.swap import AioSettings
from shardspeed.zero.swap.param_swapper import build_param_tier
from shardspeed.zero.zenflow import ZenFlowZeroOptimizer

__all__ = ["StageSettings", "loader_steps_per_epoch", "wrap_optimizer"]


@dataclass(frozen=True)
class StageSettings:
    """What the stage wrappers read from the config: three blocks and the top-level gradient keys."""

    zero: ZeroConfig
    fp16: Fp16Config
    """The loss scaler's settings (fp16, or an fp16 torch_autocast)."""
    aio: AioConfig
    """NVMe offload's file I/O."""
    gradient_clipping: float
    prescale_gradients: bool
    gradient_predivide_factor: float
    average_gradients: bool
    """`gradient_allreduce_op` is "mean" (else "sum")."""
    allow_untested_optimizer: bool

    @classmethod
    def from_config(cls, config) -> StageSettings:
        """The blocks of a `ShardspeedConfig` (shared, not copied)."""
        return cls(
            zero=config.zero_optimization,
            fp16=config.fp16,
            aio=config.aio,
            gradient_clipping=config.gradient_clipping,
            prescale_gradients=config.prescale_gradients,
            gradient_predivide_factor=config.gradient_predivide_factor,
            average_gradients=config.gradient_allreduce_op == "mean",
            allow_untested_optimizer=config.zero_allow_untested_optimizer,
        )


def wrap_optimizer(module, optimizer: torch.optim.Optimizer, settings: StageSettings, *, plan: PrecisionPlan,
                   group, moe=None, zeropp=None, steps_per_epoch: int | None = None):  # fmt: skip
    """The stage's wrapper around the torch optimizer of `module`'s trainable parameters, averaging over the
    replica `group` (None: the world); with MoE (`moe`, the engine's ExpertParallelism) one wrapper per
    reduction domain. `zeropp`: ZeRO++'s part (stage 3), or None. `steps_per_epoch`: optimizer steps per
    pass over the training dataloader, when the engine has one (ZenFlow's "epoch" selection)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    scaler = make_scaler(settings.fp16, plan)

    def wrap(opt, sub, domain_group, owned=None):
        return _wrap_params(module, opt, sub, domain_group, scaler, settings, plan, group, zeropp, owned,
                            steps_per_epoch)  # fmt: skip

    if moe is not None:  # one wrapper per reduction domain (dense, each expert group)
        if settings.zero.zenflow is not None:  # (its column selection is per wrapper, not built per domain)
            raise ConfigError("zero_optimization.zenflow: ZenFlow is not supported with MoE layers")
        return moe.wrap_optimizer(optimizer, named, wrap, scaler=scaler, clip=settings.gradient_clipping)
    return wrap(optimizer, named, group)


def _wrap_params(module, optimizer, named, group, scaler, settings: StageSettings, plan: PrecisionPlan,
                 replica_group, zeropp, owned: set[int] | None = None, steps_per_epoch=None):  # fmt: skip
    """The stage's wrapper over the parameters `named`, reduced over `group` (stage 3: `owned` are the
    ids of the module parameters it partitions, frozen ones included; None for all). `replica_group` is
    the whole data-parallel group, over which parameter offload sizes its NVMe share."""
    zero = settings.zero
    common = dict(plan=plan, scaler=scaler, gradient_clipping=settings.gradient_clipping)
    reduce_options = dict(
        group=group,
        prescale_gradients=settings.prescale_gradients,
        gradient_predivide_factor=settings.gradient_predivide_factor,
        average=settings.average_gradients,
    )
    if zero.stage == 0:  # (optimizer offload at stage 0 is refused by the config)
        by_comm_dtype = lambda p: comm_dtype_of(p, plan.comm_dtype)  # noqa: E731
        layout = bucket_layout([[p for _, p in named]], int(zero.reduce_bucket_size), by_comm_dtype)
        reducer = BucketedAllReducer(
            [params for _, params in layout],
            accum_dtype=plan.grad_accum_dtype,
            comm_dtype=plan.comm_dtype,
            **reduce_options,
        )
        return DataParallelOptimizer(optimizer, named, reducer=reducer, **common)
    _check_zero_optimizer(optimizer, settings.allow_untested_optimizer)
    common["offload"] = _optimizer_offload(zero, settings.aio)
    if zero.stage == 3:
        param_tier = build_param_tier(zero.offload_param, AioSettings.from_config(settings.aio), module,
                                      replica_group)  # fmt: skip
        return zero_stage_3(module, optimizer, named, zero, owned=owned, param_tier=param_tier, zeropp=zeropp,
                            **common, **reduce_options)  # fmt: skip
    if zero.zenflow is not None:  # (the config allows it at stages 1-2 with offload_optimizer cpu only)
        zenflow = dict(zenflow=zero.zenflow, loader_steps_per_epoch=steps_per_epoch)
        return zero_stage_1_2(optimizer, named, zero, wrapper_cls=ZenFlowZeroOptimizer, wrapper_options=zenflow,
                              **common, **reduce_options)  # fmt: skip
    return zero_stage_1_2(optimizer, named, zero, **common, **reduce_options)


def loader_steps_per_epoch(loader, gradient_accumulation_steps: int) -> int | None:
    """Optimizer steps in one pass over `loader` (None: no loader, or one without a length)."""
    try:
        return len(loader) // gradient_accumulation_steps if loader is not None else None
    except TypeError:
        return None


def _optimizer_offload(zero: ZeroConfig, aio: AioConfig) -> OptimizerOffload | None:
    block = zero.offload_optimizer
    if block is None or block.device == "none":
        return None
    return OptimizerOffload(
        block.device, block.nvme_path, block.pin_memory, block.buffer_count, block.pipeline_read,
        block.pipeline_write, AioSettings.from_config(aio),
    )  # fmt: skip


def _check_zero_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    if is_zero_tested_optimizer(optimizer) or allow_untested:
        return
    raise ConfigError(
        f"zero_allow_untested_optimizer: {type(optimizer).__name__} is not known to work with ZeRO, which "
        "steps flat shards instead of whole tensors (a per-tensor rule such as LAMB's trust ratio would "
        'apply per shard). Use Adam/AdamW/Adagrad/Lion, or set "zero_allow_untested_optimizer": true.'
    )
