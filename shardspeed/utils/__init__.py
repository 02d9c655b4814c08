"""Small helpers shared across the package (logging), and DeepSpeed's `utils.RepeatingLoader`."""

from shardspeed.utils.logging import log_dist, logger

__all__ = ["RepeatingLoader", "log_dist", "logger"]


def __getattr__(name: str):
    if name == "RepeatingLoader":  # lazily: runtime.data imports torch, which the launcher must not pay for
        from shardspeed.runtime.data import RepeatingLoader

        return RepeatingLoader
    raise AttributeError(f"module 'shardspeed.utils' has no attribute {name!r}")
