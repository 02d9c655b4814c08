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

import sys

from shardspeed.utils.logging import make_logger


class LauncherError(ValueError):
    """A problem with the user's input or machine, reported as one clear line before anything starts."""


log = make_logger("shardspeed.launcher", "shardspeed launcher", sys.stderr)

__all__ = ["LauncherError", "log"]
