"""The `shardspeed` launcher: start a training script on one node or many, like the `deepspeed` command.

Modules, in the order a launch goes through them:

- `runner`     the `shardspeed` CLI: parses DeepSpeed's flags, validates everything, picks a backend
- `hostfile`   hostfile parsing, the include/exclude grammar and resource selection
- `env`        which environment variables travel to other nodes (prefixes, `.deepspeed_env` files)
- `multinode`  argv builders for the ssh, pdsh, OpenMPI, MPICH, Intel MPI and SLURM backends
- `launch`     the per-node launcher (`python -m shardspeed.launcher.launch`), one process per local rank
- `supervise`  starts processes in their own groups, forwards output, stops the job when one fails
- `report`     `shardspeed report`, the counterpart of `ds_report`

Nothing here imports torch at module level: the launcher starts before any rank and should start fast.
"""

from __future__ import annotations

import os
import sys

from shardspeed.utils.logging import make_logger


class LauncherError(ValueError):
    """A problem with the user's input or machine, reported as one clear line before anything starts."""


log = make_logger("shardspeed.launcher", "shardspeed launcher", sys.stderr)


# Here, beside the error type, because both entry points end with it: the `shardspeed` command (runner)
# and the per-node launcher (launch), which must not import each other.
def fast_exit(code: int) -> int:
    """Exit now, skipping interpreter teardown.

    `import shardspeed` loads torch, whose teardown takes ~0.3 s; the job is over and every child has
    been reaped, so nothing is lost and a failure reaches the caller (or the runner, for a remote
    per-node launcher) that much sooner.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["LauncherError", "fast_exit", "log"]
