"""shardspeed: DeepSpeed's training API and JSON config, in pure Python on PyTorch.

import shardspeed as deepspeed
engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")
"""

from shardspeed import comm
from shardspeed.api import add_config_arguments, initialize
from shardspeed.checkpoint import CheckpointError
from shardspeed.comm.init import init_distributed
from shardspeed.config import ConfigError
from shardspeed.runtime.data import RepeatingLoader
from shardspeed.runtime.engine import ShardspeedEngine
from shardspeed.version import __version__

DeepSpeedConfigError = ConfigError
DeepSpeedEngine = ShardspeedEngine

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "RepeatingLoader",
    "ShardspeedEngine",
    "__version__",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
]
