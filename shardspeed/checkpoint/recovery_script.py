"""The `zero_to_fp32.py` recovery script written beside ZeRO checkpoints, as DeepSpeed writes its own.

DeepSpeed copies its `zero_to_fp32.py` into the folder given to `save_checkpoint` whenever optimizer state is
partitioned (ZeRO stages 1-3), and its documentation (and Hugging Face's) tells users to run it from there:
`python zero_to_fp32.py . pytorch_model.bin`. shardspeed writes a script of the same name taking the same
arguments; it runs shardspeed's consolidation (`shardspeed.checkpoint.consolidate.main`), so it needs shardspeed
installed where it runs, as DeepSpeed's needs DeepSpeed. It is written by rank 0 after the checkpoint is
published, through a temporary name, and made executable. A file system that refuses the permission change
(network file shares) or a script that is already gone only logs: the checkpoint itself is complete.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardspeed.utils.logging import logger

__all__ = ["SCRIPT_NAME", "make_executable", "write_recovery_script"]

SCRIPT_NAME = "zero_to_fp32.py"

_SCRIPT = '''#!/usr/bin/env python
"""Consolidate the ZeRO checkpoint in this folder into fp32 weights (written by shardspeed at save time).

    python zero_to_fp32.py <checkpoint folder> <output folder> [--safe_serialization] [--max_shard_size 5GB]
                           [-t TAG] [--exclude_frozen_parameters] [-d]

The arguments of DeepSpeed's zero_to_fp32.py; the same as `shardspeed-zero-to-fp32`.
"""

from shardspeed.checkpoint.consolidate import main

if __name__ == "__main__":
    raise SystemExit(main())
'''


def write_recovery_script(save_dir) -> Path:
    """Write `<save_dir>/zero_to_fp32.py` (replacing an older copy in one step) and make it executable."""
    path = Path(save_dir) / SCRIPT_NAME
    tmp = path.with_name(f".{SCRIPT_NAME}.tmp-{os.getpid()}")
    tmp.write_text(_SCRIPT)
    os.replace(tmp, path)
    make_executable(path)
    return path


def make_executable(path) -> None:
    """Add the owner's execute permission to `path`. Where the file system refuses it (Azure file shares) or
    the file is missing, log that and go on: running it with `python` needs no permission bit."""
    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    except (FileNotFoundError, PermissionError) as err:
        logger.info(f"could not make {path} executable ({err}); continuing without changing its permissions")
