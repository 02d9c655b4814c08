"""Small helpers shared across the package (logging)."""

from shardspeed.utils.logging import log_dist, logger

__all__ = ["log_dist", "logger"]
