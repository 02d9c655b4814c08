"""DeepSpeed's `deepspeed.runtime.config` / `runtime.constants` name constants that code builds configs with.

`ADAM_OPTIMIZER` is the string DeepSpeed's config uses for that optimizer's `type`, `TRAIN_BATCH_SIZE` the
top-level key, and so on. The optimizer names are DeepSpeed's `optimizer.type` strings (shardspeed builds
adam, adamw, lamb, lion and adagrad, and refuses the others by name: shardspeed/runtime/optim.py); the key
constants are generated from the fields of shardspeed's own config schema (the same names DeepSpeed uses),
so they cannot drift from what loads.
"""

from __future__ import annotations

import dataclasses

from shardspeed.config.schema import ShardspeedConfig

ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
ADAGRAD_OPTIMIZER = "adagrad"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER,
    LION_OPTIMIZER, MUON_OPTIMIZER,
]  # fmt: skip
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True
LOG_LEVEL_DEFAULT = None  # DeepSpeed's default: the logger's level is left as it is

# DeepSpeed's `<KEY>_DEFAULT` constants that code compares with, read from the schema so they cannot drift
GRADIENT_CLIPPING_DEFAULT = next(
    f.default for f in dataclasses.fields(ShardspeedConfig) if f.name == "gradient_clipping"
)

# Every top-level key of the config as a constant: TRAIN_BATCH_SIZE = "train_batch_size", ...
for _field in dataclasses.fields(ShardspeedConfig):
    if not _field.name.startswith("_") and _field.name not in ("raw", "world_size"):
        globals().setdefault(_field.name.upper(), _field.name)

__all__ = sorted(name for name in dict(globals()) if name.isupper())
