"""Deprecated config forms that are not simple key renames (reference §2.15).

Simple renames (``bfloat16`` -> ``bf16``, ``prefetch_bucket_size`` -> ``stage3_prefetch_bucket_size``,
``stage3_gather_fp16_weights_on_model_save`` -> ``stage3_gather_16bit_weights_on_model_save``, ...) are
declared as ``Key(aliases=...)`` on the field itself. This module rewrites the forms that change shape:

* ``"zero_optimization": true/false``           -> ``{"stage": 1}`` / ``{"stage": 0}``
* top-level ``allgather_size``                    -> ``zero_optimization.allgather_bucket_size``
* ``zero_optimization.cpu_offload: true``         -> ``zero_optimization.offload_optimizer: {"device": "cpu"}``
* ``zero_optimization.cpu_offload_param: true``   -> ``zero_optimization.offload_param: {"device": "cpu"}``
  (``false`` sets nothing: no offload, the default, as DeepSpeed maps it to no block)
* ``zero_optimization.cpu_offload_use_pin_memory`` -> ``pin_memory`` of those offload blocks (none: no effect)
* ``zero_optimization.elastic_checkpoint: true`` at stage 3: kept, with DeepSpeed's deprecation warning

Each mapping adds a note (warned by the loader) saying what it did; giving an old form and its replacement
is an error.
"""

from __future__ import annotations

from typing import Any

from .build import BuildContext, show
from .errors import ConfigError

__all__ = ["map_deprecated"]

ZERO = "zero_optimization"


def map_deprecated(config: dict[str, Any], ctx: BuildContext) -> dict[str, Any]:
    """Rewrite deprecated forms in ``config`` (a private copy: it is modified in place and returned)."""
    _zero_as_bool(config, ctx)
    _allgather_size(config, ctx)
    zero = config.get(ZERO)
    if isinstance(zero, dict):
        _cpu_offload(zero, "cpu_offload", "offload_optimizer", ctx)
        _cpu_offload(zero, "cpu_offload_param", "offload_param", ctx)
        _pin_memory(zero, ctx)
        _elastic_checkpoint_at_stage3(zero, ctx)
    return config


def _note(ctx: BuildContext, old: str, new: str) -> None:
    ctx.notes.append(f"config key '{old}' is deprecated; it was mapped to '{new}' (use that instead)")


def _require_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected a boolean (true/false), got {show(value)}")
    return value


def _zero_as_bool(config: dict[str, Any], ctx: BuildContext) -> None:
    value = config.get(ZERO)
    if isinstance(value, bool):
        stage = 1 if value else 0
        config[ZERO] = {"stage": stage}
        ctx.notes.append(
            f"config key '{ZERO}': {show(value)} is deprecated; it was mapped to '{ZERO}': {{\"stage\": {stage}}}"
        )


def _allgather_size(config: dict[str, Any], ctx: BuildContext) -> None:
    if "allgather_size" not in config:
        return
    value = config.pop("allgather_size")
    zero = config.setdefault(ZERO, {})
    if not isinstance(zero, dict):
        return  # the type error on zero_optimization itself is reported by the builder
    if "allgather_bucket_size" in zero:
        raise ConfigError(
            f"allgather_size: both the deprecated 'allgather_size' and '{ZERO}.allgather_bucket_size' "
            f"are given; remove 'allgather_size'"
        )
    zero["allgather_bucket_size"] = value
    _note(ctx, "allgather_size", f"{ZERO}.allgather_bucket_size")


_OFFLOADED = {"offload_optimizer": "optimizer", "offload_param": "parameter"}


def _cpu_offload(zero: dict[str, Any], old: str, new: str, ctx: BuildContext) -> None:
    if old not in zero:
        return
    enabled = _require_bool(zero.pop(old), f"{ZERO}.{old}")
    if new in zero:
        raise ConfigError(
            f"{ZERO}.{old}: both the deprecated '{ZERO}.{old}' and '{ZERO}.{new}' are given; remove '{old}'"
        )
    if enabled:
        zero[new] = {"device": "cpu"}
        _note(ctx, f"{ZERO}.{old}", f'{ZERO}.{new}: {{"device": "cpu"}}')
    else:  # the note says what happened: nothing
        ctx.notes.append(
            f"config key '{ZERO}.{old}': false is deprecated; it means no {_OFFLOADED[new]} offload, the default, "
            f"so nothing was set (remove it; '{ZERO}.{new}' replaces it)"
        )


def _pin_memory(zero: dict[str, Any], ctx: BuildContext) -> None:
    old = "cpu_offload_use_pin_memory"
    if old not in zero:
        return
    pin = _require_bool(zero.pop(old), f"{ZERO}.{old}")
    pinned = []
    for block_name in ("offload_optimizer", "offload_param"):
        block = zero.get(block_name)
        if not isinstance(block, dict):
            continue
        if "pin_memory" in block:
            raise ConfigError(
                f"{ZERO}.{old}: both the deprecated '{ZERO}.{old}' and '{ZERO}.{block_name}.pin_memory' "
                f"are given; remove '{old}'"
            )
        block["pin_memory"] = pin
        pinned.append(f"{ZERO}.{block_name}.pin_memory")
    if pinned:
        _note(ctx, f"{ZERO}.{old}", " / ".join(pinned))
    else:
        ctx.notes.append(
            f"config key '{ZERO}.{old}' is deprecated; there is no offload block to pin, so it has no effect "
            f"(remove it; 'pin_memory' of '{ZERO}.offload_optimizer' / '{ZERO}.offload_param' replaces it)"
        )


def _elastic_checkpoint_at_stage3(zero: dict[str, Any], ctx: BuildContext) -> None:
    """DeepSpeed deprecated ZeRO-3 elastic checkpoints for universal checkpoints and warns about the key; here
    every checkpoint loads at any world size and stage, so the key changes nothing, and the warning says so."""
    if zero.get("elastic_checkpoint") is True and zero.get("stage") == 3:
        ctx.notes.append(
            f"config key '{ZERO}.elastic_checkpoint': ZeRO-3 elastic checkpointing is deprecated (DeepSpeed no "
            "longer supports it; use universal checkpointing). shardspeed's checkpoints load at any world size "
            "and ZeRO stage without it (remove the key)"
        )
