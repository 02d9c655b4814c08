"""Small helpers shared across the package (logging), and DeepSpeed's `utils` names integrations import."""

from shardspeed.utils.logging import log_dist, logger
from shardspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = [
    "get_z3_leaf_modules",
    "log_dist",
    "logger",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
