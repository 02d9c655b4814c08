"""DeepSpeed's `deepspeed.runtime.config.DeepSpeedConfig`: a loaded config read through DeepSpeed's names.

Megatron-style code and DeepSpeed's tests build `DeepSpeedConfig(config_dict_or_path, mpu)` on their own and
read `train_batch_size`, `zero_config`, `zero_optimization_stage`, `fp16_enabled`, ... from it. This class
loads the config with shardspeed's one config system (`shardspeed.config.load_config`, so every check and
error is the same as in `initialize`), at the data-parallel world size of the running process group (or of
`mpu`), and answers DeepSpeed's attribute names from the result; any other attribute is the loaded
`ShardspeedConfig`'s block of that name (`config.zero_optimization`, `config.checkpoint`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from shardspeed.config import ConfigError, load_config, resolve_batch_sizes
from shardspeed.config.blocks import Bf16Config, Fp16Config
from shardspeed.config.build import BuildContext, build_block
from shardspeed.config.monitoring import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig
from shardspeed.moe.autoep.apply import block_to_config

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedMonitorConfig",
    "get_bfloat16_config",
    "get_float16_config",
    "get_gradient_clipping",
    "get_log_level",
]


@dataclass(kw_only=True)
class DeepSpeedMonitorConfig:
    """DeepSpeed's `monitor.config.DeepSpeedMonitorConfig`: the four monitor blocks (defaults when absent)."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CsvMonitorConfig = field(default_factory=CsvMonitorConfig)
    comet: CometConfig = field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        return any(block.enabled for block in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))


# DeepSpeed attribute -> function of the loaded ShardspeedConfig
_DEEPSPEED_NAMES = {
    "zero_config": lambda c: c.zero_optimization,
    "zero_optimization_stage": lambda c: c.zero_optimization.stage,
    "zero_enabled": lambda c: c.zero_optimization.stage > 0,
    "fp16_enabled": lambda c: c.fp16.enabled,
    "bfloat16_enabled": lambda c: c.bf16.enabled,
    "fp16_auto_cast": lambda c: c.fp16.auto_cast,
    "loss_scale": lambda c: c.fp16.loss_scale,
    "initial_dynamic_scale": lambda c: 2**c.fp16.initial_scale_power,
    "optimizer_name": lambda c: c.optimizer.type.lower() if c.optimizer else None,
    "optimizer_params": lambda c: dict(c.optimizer.params) if c.optimizer else None,
    "scheduler_name": lambda c: c.scheduler.type if c.scheduler else None,
    "scheduler_params": lambda c: dict(c.scheduler.params) if c.scheduler else None,
    "activation_checkpointing_config": lambda c: c.activation_checkpointing,
    "pipeline": lambda c: c.pipeline,
    "_param_dict": lambda c: c.raw,
    "monitor_config": lambda c: DeepSpeedMonitorConfig(
        tensorboard=c.tensorboard, wandb=c.wandb, csv_monitor=c.csv_monitor, comet=c.comet
    ),
}


def _data_parallel_world_size(mpu) -> int:
    if mpu is not None:
        return mpu.get_data_parallel_world_size()
    return dist.get_world_size() if dist.is_initialized() else 1


class DeepSpeedConfig:
    """A DeepSpeed config (dict, JSON/HJSON path or base64 string) loaded and checked, with DeepSpeed's names."""

    def __init__(self, config, mpu=None, mesh_device=None) -> None:
        if mesh_device is not None:
            raise ValueError("DeepSpeedConfig(mesh_device=...): pass the layout through the config or an mpu")
        self.world_size = _data_parallel_world_size(mpu)
        self.loaded = load_config(config, world_size=self.world_size)
        # DeepSpeed parses the AutoEP block here (a non-null load_balance_coeff is refused at once)
        self.expert_parallel_config = block_to_config(self.loaded.expert_parallel)

    def __getattr__(self, name: str):
        if name == "loaded":  # not set yet: __init__ failed part-way
            raise AttributeError(name)
        if name in _DEEPSPEED_NAMES:
            return _DEEPSPEED_NAMES[name](self.loaded)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.loaded, name)

    def _configure_train_batch_size(self) -> None:
        """DeepSpeed's method (its tests set the three batch attributes, then call it): resolve them as
        `initialize` does, filling in the one missing; AssertionError, as DeepSpeed raises, when they cannot
        agree (the message names the keys)."""
        try:
            resolved = resolve_batch_sizes(
                self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps,
                self.world_size,
            )  # fmt: skip
        except ConfigError as error:
            raise AssertionError(str(error)) from error
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = (
            resolved
        )

    def print(self, name: str = "DeepSpeedConfig") -> None:
        print(f"{name}: {self.loaded.to_dict()}")


def _block(param_dict: dict, cls: type, names: tuple[str, ...]):
    for name in names:
        if name in param_dict:
            return build_block(cls, param_dict[name], name, BuildContext())
    return cls()


def get_bfloat16_config(param_dict: dict) -> Bf16Config:
    """DeepSpeed's `runtime.precision_config.get_bfloat16_config`: the `bf16` block (or its old name
    `bfloat16`) of a config dict, checked as `initialize` checks it; defaults when absent."""
    return _block(param_dict, Bf16Config, ("bf16", "bfloat16"))


def get_float16_config(param_dict: dict) -> Fp16Config:
    """DeepSpeed's `runtime.precision_config.get_float16_config`: the `fp16` block of a config dict."""
    return _block(param_dict, Fp16Config, ("fp16",))


def get_log_level(param_dict: dict) -> str | None:
    """DeepSpeed's `runtime.config.get_log_level`: the config's `log_level` as the engine keeps it (upper
    case), None when absent; a value that is not a level is a ConfigError naming the key."""
    if param_dict.get("log_level") is None:
        return None
    return load_config({"train_micro_batch_size_per_gpu": 1, "log_level": param_dict["log_level"]}).log_level


def get_gradient_clipping(param_dict: dict) -> float:
    """DeepSpeed's `runtime.config.get_gradient_clipping`: the config's `gradient_clipping` as the engine uses
    it, the schema's default (1.0, as in DeepSpeed 0.19) when absent; a bad value is a ConfigError naming it."""
    config = {"train_micro_batch_size_per_gpu": 1}
    if param_dict.get("gradient_clipping") is not None:
        config["gradient_clipping"] = param_dict["gradient_clipping"]
    return load_config(config).gradient_clipping
