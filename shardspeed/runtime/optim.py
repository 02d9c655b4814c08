"""Optimizer construction from the config's `"optimizer"` block (DeepSpeed's names and params), and the set
of optimizers ZeRO accepts without `zero_allow_untested_optimizer`.

Name mapping (DeepSpeed's names match in any case; then any `torch.optim` class, exact name first):

| type | optimizer built |
|---|---|
| `adam` | `torch.optim.AdamW` (`adam_w_mode` true, the default) or `torch.optim.Adam` (L2 decay) |
| `adamw` | `torch.optim.AdamW` whatever `adam_w_mode` says |
| `adam`/`adamw` with optimizer offload | `ops.adam.DeepSpeedCPUAdam` |
| `adam`/`adamw` given `bias_correction`/`set_grad_none` | `ops.adam.FusedAdam` (torch cannot turn bias correction off) |
| `lamb` | `ops.lamb.FusedLamb` |
| `lion` | `ops.lion.FusedLion` (`DeepSpeedCPULion` with offload) |
| `adagrad` | `torch.optim.Adagrad` (`DeepSpeedCPUAdagrad` with offload) |
| `SGD`, `RMSprop`, ... | that `torch.optim` class |

torch's fused kernel is used for Adam/AdamW (and Adagrad on CPU) when every parameter can take it, foreach
otherwise; an explicit `fused`/`foreach` in the params wins.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from shardspeed.config.errors import ConfigError, closest_name, refuse_unknown_keywords
from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad
from shardspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardspeed.ops.lamb import FusedLamb
from shardspeed.ops.lion import DeepSpeedCPULion, FusedLion
from shardspeed.optimizers._impl import can_use_fused
from shardspeed.optimizers.lion import Lion
from shardspeed.utils.logging import logger

__all__ = ["DEEPSPEED_OPTIMIZERS", "ZERO_TESTED_OPTIMIZERS", "build_optimizer", "is_zero_tested_optimizer"]

_KEY = "optimizer.params"

DEEPSPEED_OPTIMIZERS = ("adam", "adamw", "lamb", "lion", "adagrad")

# DeepSpeed names we refuse: they need DeepSpeed's compressed collectives or the `mup` package.
_UNSUPPORTED = {
    "onebitadam": "1-bit Adam (compressed communication)",
    "zerooneadam": "0/1 Adam (compressed communication)",
    "onebitlamb": "1-bit LAMB (compressed communication)",
    "muadam": "MuAdam (the mup package)",
    "muadamw": "MuAdamW (the mup package)",
    "musgd": "MuSGD (the mup package)",
}

# Exact types (not subclasses) ZeRO runs without `zero_allow_untested_optimizer`: their updates are
# elementwise, so running them on flat partitions equals running them on whole tensors. LAMB is left out
# on purpose: its per-tensor trust ratio would become a per-partition one.
ZERO_TESTED_OPTIMIZERS: frozenset[type] = frozenset(
    {
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        FusedAdam,
        DeepSpeedCPUAdam,
        DeepSpeedCPUAdagrad,
        FusedLion,
        DeepSpeedCPULion,
        Lion,
    }
)

# torch classes whose fused kernel matched foreach within 2.4e-7 here, and the devices it may run on.
_FUSED_CHECKED: dict[type, tuple[str, ...] | None] = {
    torch.optim.Adam: None,
    torch.optim.AdamW: None,
    torch.optim.Adagrad: ("cpu",),
}

_FUSED_ADAM_ONLY = frozenset({"bias_correction", "set_grad_none"})

# DeepSpeed's classes that refuse amsgrad=True.
_NO_AMSGRAD = (FusedAdam, DeepSpeedCPUAdam, FusedLamb, DeepSpeedCPUAdagrad)


def is_zero_tested_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """True when ZeRO may run `optimizer` without `zero_allow_untested_optimizer`."""
    return type(optimizer) in ZERO_TESTED_OPTIMIZERS


# --- parameters ---------------------------------------------------------------------------------------


def _as_tensor_list(params: Any, where: str) -> list:
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    for item in items:
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{where}: expected tensors, got {type(tensor).__name__}")
    return items


def normalize_param_groups(model_parameters: Iterable[Any] | None) -> list:
    """`model_parameters` as a list of tensors or of param-group dicts with list `params`: empty groups
    dropped, a parameter in two groups refused."""
    if model_parameters is None:
        raise ConfigError("model_parameters: no parameters given to build the optimizer from")
    items = [model_parameters] if isinstance(model_parameters, torch.Tensor) else list(model_parameters)
    if any(isinstance(item, dict) for item in items):
        if not all(isinstance(item, dict) for item in items):
            raise ConfigError("model_parameters: mixes param-group dicts with bare tensors")
        groups = []
        for i, group in enumerate(items):
            if "params" not in group:
                raise ConfigError(f"model_parameters[{i}]: a param group needs a 'params' entry")
            groups.append(
                dict(group, params=_as_tensor_list(group["params"], f"model_parameters[{i}].params"))
            )
        groups = [g for g in groups if g["params"]]
        tensors_by_group = [g["params"] for g in groups]
    else:
        groups = _as_tensor_list(items, "model_parameters")
        tensors_by_group = [groups]
    if not any(tensors_by_group):
        raise ConfigError("model_parameters: there are no parameters to optimize")
    _refuse_duplicates(tensors_by_group)
    return groups


def _refuse_duplicates(tensors_by_group: list[list]) -> None:
    seen: dict[int, int] = {}
    for index, tensors in enumerate(tensors_by_group):
        for item in tensors:
            tensor = item[1] if isinstance(item, tuple) else item
            if id(tensor) in seen:
                raise ConfigError(
                    f"model_parameters: a parameter of shape {tuple(tensor.shape)} appears twice "
                    f"(param groups {seen[id(tensor)]} and {index})"
                )
            seen[id(tensor)] = index


# --- options ------------------------------------------------------------------------------------------


def _accepted_keywords(cls: type) -> list[str] | None:
    """Keyword arguments of `cls` after the params argument; None when it takes **kwargs."""
    arguments = list(inspect.signature(cls.__init__).parameters.values())[2:]
    if any(a.kind is a.VAR_KEYWORD for a in arguments):
        return None
    return [a.name for a in arguments if a.kind is not a.VAR_POSITIONAL]


def _check_keywords(cls: type, options: dict[str, Any], extra: Iterable[str] = ()) -> None:
    accepted = _accepted_keywords(cls)
    if accepted is None:
        return
    refuse_unknown_keywords(_KEY, cls.__name__, options, sorted(set(accepted) | set(extra)))


def _check_number(key: str, value: Any) -> None:
    if isinstance(value, str):
        raise ConfigError(f"{_KEY}.{key}: expected a number, got the string {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{_KEY}.{key}: expected a non-negative number, got {value!r}")


def _normalize_values(options: dict[str, Any]) -> dict[str, Any]:
    """Check the common numeric options and turn JSON's `betas` list into a tuple of floats."""
    for key in ("lr", "eps", "weight_decay"):
        if key in options:
            _check_number(key, options[key])
    if "betas" in options:
        betas = options["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"{_KEY}.betas: expected a list of two numbers, got {betas!r}")
        for beta in betas:
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
                raise ConfigError(f"{_KEY}.betas: each beta must be a number in [0, 1), got {betas!r}")
        options["betas"] = (float(betas[0]), float(betas[1]))
    return options


def _pop_flag(options: dict[str, Any], key: str, default: bool) -> bool:
    value = options.pop(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{_KEY}.{key}: expected true or false, got {value!r}")
    return value


# --- choosing the class -------------------------------------------------------------------------------


def _adam_choice(name: str, options: dict[str, Any], offload: bool) -> tuple[type, set[str]]:
    """The Adam-family class, with the DeepSpeed-only keys consumed from `options`.

    `torch_adam` is consumed and changes no implementation: without it DeepSpeed picks its fused kernel,
    with it torch's; both are torch's here. It does keep DeepSpeed's defaults: FusedAdam's weight_decay
    is 0, torch AdamW's 0.01.
    """
    torch_adam = _pop_flag(options, "torch_adam", False)
    adam_w_mode = _pop_flag(options, "adam_w_mode", True)
    if name == "adamw" and not adam_w_mode:
        logger.warning(f"{_KEY}.adam_w_mode=false is ignored: type AdamW always uses decoupled weight decay")
    adamw = name == "adamw" or adam_w_mode
    consumed = {"torch_adam", "adam_w_mode"}
    options.setdefault("weight_decay", 0.01 if torch_adam and adamw else 0.0)
    if offload:
        options["adamw_mode"] = adamw
        return DeepSpeedCPUAdam, consumed
    if _FUSED_ADAM_ONLY & options.keys():
        options["adam_w_mode"] = adamw
        return FusedAdam, consumed | {"adam_w_mode"}
    return (torch.optim.AdamW if adamw else torch.optim.Adam), consumed | _FUSED_ADAM_ONLY


def _torch_optimizers() -> dict[str, type]:
    return {
        name: obj
        for name, obj in vars(torch.optim).items()
        if isinstance(obj, type)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
    }


def _torch_choice(type_name: str) -> type:
    classes = _torch_optimizers()
    cls = classes.get(type_name) or {n.lower(): c for n, c in classes.items()}.get(type_name.lower())
    if cls is None:
        names = [*DEEPSPEED_OPTIMIZERS, *sorted(classes)]
        close = closest_name(type_name, names, 0.5, any_case=True)
        hint = f"; did you mean {close!r}?" if close else "."
        raise ConfigError(
            f"optimizer.type: unknown optimizer {type_name!r}{hint} Valid: {', '.join(DEEPSPEED_OPTIMIZERS)} "
            "or any torch.optim class"
        )
    if cls is torch.optim.LBFGS:
        raise ConfigError(
            "optimizer.type: LBFGS needs a closure at every step, which the engine does not pass"
        )
    return cls


def _choose(type_name: str, options: dict[str, Any], offload: bool) -> tuple[type, set[str]]:
    name = type_name.lower()
    if name in _UNSUPPORTED:
        raise ConfigError(
            f"optimizer.type: {type_name!r} ({_UNSUPPORTED[name]}) is not supported by shardspeed; "
            "use adam, adamw, lamb, lion, adagrad or a torch.optim optimizer"
        )
    if name in ("adam", "adamw"):
        return _adam_choice(name, options, offload)
    if name == "lamb":
        return FusedLamb, set()
    if name == "lion":
        return (DeepSpeedCPULion if offload else FusedLion), set()
    if name == "adagrad":
        return (DeepSpeedCPUAdagrad if offload else torch.optim.Adagrad), set()
    return _torch_choice(type_name), set()


def _kernel_options(cls: type, options: dict[str, Any], groups: list) -> None:
    """Ask torch for its fused kernel where checked and possible, else foreach (unless the user chose)."""
    accepted = _accepted_keywords(cls) or []
    if "foreach" in options or "fused" in options or "foreach" not in accepted:
        return
    if cls in _FUSED_CHECKED and "fused" in accepted and can_use_fused(groups, _FUSED_CHECKED[cls]):
        options["fused"] = True
    else:
        options["foreach"] = True


def build_optimizer(
    type_name: str, params: dict[str, Any] | None, model_parameters: Iterable[Any], *, offload: bool = False
) -> torch.optim.Optimizer:
    """The optimizer the config's `optimizer` block describes, over `model_parameters` (tensors or
    param-group dicts with their own options). `offload=True` (ZeRO optimizer offload) picks DeepSpeed's CPU
    classes, as DeepSpeed does. Every bad input is a ConfigError naming its key."""
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"optimizer.type: expected an optimizer name, got {type_name!r}")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"optimizer.params: expected an object, got {params!r}")
    options = dict(params or {})
    if "max_grad_norm" in options:
        raise ConfigError(
            f"{_KEY}.max_grad_norm: not supported inside the optimizer; use the top-level "
            f'"gradient_clipping": {options["max_grad_norm"]!r} instead'
        )
    cls, consumed = _choose(type_name, options, offload)
    _check_keywords(cls, options, extra=consumed)
    if options.get("amsgrad") and cls in _NO_AMSGRAD:
        raise ConfigError(
            f"{_KEY}.amsgrad: {cls.__name__} does not support the AMSGrad variant (as DeepSpeed)"
        )
    _normalize_values(options)
    groups = normalize_param_groups(model_parameters)
    _kernel_options(cls, options, groups)
    try:
        return cls(groups, **options)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(f"{_KEY}: {cls.__name__} refused {params}: {error}") from error
