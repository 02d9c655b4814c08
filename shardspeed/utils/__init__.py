"""Small helpers shared across the package (logging), and DeepSpeed's `utils` names integrations import."""

from shardspeed.utils.logging import log_dist, logger
from shardspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "log_dist",
    "logger",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]


def __getattr__(name: str):
    if name == "RepeatingLoader":  # lazily: runtime.data imports torch, which the launcher must not pay for
        from shardspeed.runtime.data import RepeatingLoader

        return RepeatingLoader
    raise AttributeError(f"module 'shardspeed.utils' has no attribute {name!r}")
