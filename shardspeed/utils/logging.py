"""The package logger, `make_logger` for the launcher's own, and `log_dist`, which prints on chosen ranks.

Nothing here imports torch: the launcher logs before (and without) ever loading it.
"""

from __future__ import annotations

import logging
import sys


def make_logger(name: str, tag: str, stream=sys.stdout) -> logging.Logger:
    """A logger printing `[tag LEVEL] message` to `stream`, not propagating to the root logger."""
    log = logging.getLogger(name)
    if not log.handlers:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(f"[{tag} %(levelname)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = make_logger("shardspeed", "shardspeed")


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")  # never imported just to ask
    return dist.get_rank() if dist is not None and dist.is_available() and dist.is_initialized() else 0


def log_dist(message: str, ranks: list[int] | None = (0,), level: int = logging.INFO) -> None:
    """Log `message` on the given global ranks only (`None` or `[-1]` means every rank)."""
    if ranks is None or -1 in ranks or _rank() in ranks:
        logger.log(level, f"[rank {_rank()}] {message}" if ranks is None or -1 in ranks else message)


_logged_once: set[tuple[str, tuple | None, int]] = set()


def log_dist_once(message: str, ranks: list[int] | None = (0,), level: int = logging.INFO) -> None:
    """`log_dist`, but each distinct (message, ranks, level) only the first time (DeepSpeed's name)."""
    key = (message, tuple(ranks) if ranks is not None else None, level)
    if key not in _logged_once:
        _logged_once.add(key)
        log_dist(message, ranks, level)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the package logger's (or `custom_logger`'s) level from a name: "debug", "info", "WARNING", ..."""
    level = logging.getLevelName(str(log_level_str).upper())
    if not isinstance(level, int):
        raise ValueError(
            f"log level {log_level_str!r}: expected one of debug, info, warning, error, critical"
        )
    (custom_logger or logger).setLevel(level)
