"""The package logger and `log_dist`, which prints only on chosen ranks."""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

logger = logging.getLogger("shardspeed")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[shardspeed %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_dist(message: str, ranks: list[int] | None = (0,), level: int = logging.INFO) -> None:
    """Log `message` on the given global ranks only (`None` or `[-1]` means every rank)."""
    if ranks is None or -1 in ranks or _rank() in ranks:
        logger.log(level, f"[rank {_rank()}] {message}" if ranks is None or -1 in ranks else message)
