"""One outcome on every rank: a checkpoint step that fails on one rank fails, the same way, on all of them.

`save_checkpoint` and `load_checkpoint` are collectives. If one rank raised (an unwritable folder, a
client state that cannot be saved, different arguments on different ranks) while the others went on to
the next barrier, those would wait there until the process group's timeout, minutes later. Instead each
step runs through `agree(what, step)`: every rank runs its part, then all exchange their outcomes in one
small all-gather, and if any rank failed every rank raises the same error — the first failing rank's
exception type (for the standard ones below) and message, naming that rank. Nothing waits longer than the
slowest rank's own work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.checkpoint.files import CheckpointError
from shardspeed.comm.collectives import all_gather_strings

__all__ = ["TagMismatchError", "agree"]


class TagMismatchError(CheckpointError, AssertionError):
    """Ranks save under different tags with `checkpoint.tag_validation: "Fail"` (an AssertionError, as
    DeepSpeed raises)."""


# Exception types re-raised as themselves on every rank; any other becomes a CheckpointError.
_KEPT = {
    cls.__name__: cls
    for cls in (
        ValueError, TypeError, CheckpointError, TagMismatchError, OSError, PermissionError, FileNotFoundError,
        FileExistsError, NotADirectoryError, IsADirectoryError,
    )
}  # fmt: skip
_SEPARATOR = "\x1f"


def agree(what: str, step: Callable[[], Any] | BaseException | None, device: torch.device) -> Any:
    """Run `step()` on this rank (or take the exception it already raised), then raise on every rank if it
    failed on any. Returns `step()`'s result when every rank succeeded. Collective."""
    result, failure = None, None
    if isinstance(step, BaseException):
        failure = step
    elif step is not None:
        try:
            result = step()
        except Exception as err:  # reported to every rank just below
            failure = err
    report = "" if failure is None else f"{type(failure).__name__}{_SEPARATOR}{failure}"
    reports = all_gather_strings(report, device)
    failed = [(rank, r) for rank, r in enumerate(reports) if r]
    if not failed:
        return result
    rank, first = failed[0]
    kind, message = first.split(_SEPARATOR, 1)
    if kind not in _KEPT:
        message = f"{kind}: {message}"
    others = [r for r, _ in failed[1:]]
    where = f"rank {rank}" + (f" (and ranks {others})" if others else "")
    error = _KEPT.get(kind, CheckpointError)(f"{what} failed on {where}: {message}")
    raise error from failure
