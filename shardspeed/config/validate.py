"""Checks across config blocks (a single block's own checks live in its ``validate`` method).

The loader runs ``check_all`` once every block is built; this module only reads the finished config, so
``schema.py`` does not import it (no import cycle between the two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .schema import ShardspeedConfig

__all__ = ["check_all"]


def check_all(cfg: ShardspeedConfig) -> None:
    """Every cross-block rule, in the order a user would want to hear about them."""
    check_precision(cfg)
    check_gradient_predivide(cfg)
    check_gradient_allreduce_op(cfg)
    check_compute_grad_norm(cfg)


def model_dtype_name(cfg: ShardspeedConfig) -> str:
    """The training dtype the precision blocks select: fp16, bf16 or fp32."""
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def check_precision(cfg: ShardspeedConfig) -> None:
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled: both are true; enable at most one precision")
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None and param_dtype != model_dtype_name(cfg):
        raise ConfigError(
            f"data_types.param_dtype: {param_dtype!r} conflicts with the enabled precision (the model trains "
            f"in {model_dtype_name(cfg)}); set the matching fp16/bf16 'enabled' flag or remove param_dtype"
        )
    if cfg.torch_autocast.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        raise ConfigError(
            "torch_autocast.enabled: torch.autocast runs an fp32 model in lower precision; it cannot be "
            "combined with fp16.enabled or bf16.enabled (which make the model itself 16-bit)"
        )


def check_gradient_predivide(cfg: ShardspeedConfig) -> None:
    zero = cfg.zero_optimization
    if cfg.gradient_predivide_factor != 1.0 and zero.stage in (1, 2) and zero.reduce_scatter:
        raise ConfigError(
            f"gradient_predivide_factor: {cfg.gradient_predivide_factor} is not supported with "
            f"zero_optimization.stage {zero.stage} and zero_optimization.reduce_scatter true; "
            f"set it to 1.0 or set reduce_scatter to false"
        )


def check_gradient_allreduce_op(cfg: ShardspeedConfig) -> None:
    if cfg.gradient_allreduce_op != "sum":
        return
    if cfg.zero_optimization.stage == 3:
        raise ConfigError(
            "gradient_allreduce_op: 'sum' is not supported with ZeRO stage 3 (zero_optimization.stage 3, as in "
            "DeepSpeed); use 'mean' or a lower stage"
        )
    # DeepSpeed refuses these two combinations in these words; shardspeed implements neither feature, which
    # the message says too, so the user learns both reasons at once
    if cfg.zero_optimization.zenflow is not None:
        raise ConfigError(
            "gradient_allreduce_op: 'sum' is not supported with ZenFlow (zero_optimization.zenflow, as in "
            "DeepSpeed), and ZenFlow itself is not implemented by shardspeed; remove zero_optimization.zenflow"
        )
    if cfg.compile.deepcompile:
        raise ConfigError(
            "gradient_allreduce_op: 'sum' is not supported with DeepCompile (compile.deepcompile, as in "
            "DeepSpeed), and DeepCompile itself is not implemented by shardspeed; remove compile.deepcompile"
        )


def check_compute_grad_norm(cfg: ShardspeedConfig) -> None:
    zero = cfg.zero_optimization
    if zero.compute_grad_norm:
        return
    if cfg.gradient_clipping > 0:
        raise ConfigError(
            f"zero_optimization.compute_grad_norm: false needs gradient_clipping 0 (clipping needs the norm), "
            f"got gradient_clipping {cfg.gradient_clipping}"
        )
    offload = zero.offload_optimizer
    if offload is not None and offload.enabled:
        raise ConfigError(
            "zero_optimization.compute_grad_norm: false is not supported with optimizer offload "
            f"(zero_optimization.offload_optimizer.device is {offload.device!r})"
        )
