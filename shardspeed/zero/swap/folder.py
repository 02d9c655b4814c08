"""Swap folders under `nvme_path`: checked before training starts, removed at exit, cleaned after a crash.

Every rank swaps into its own folder `<nvme_path>/shardspeed-swap-<pid>-<what>-rank<r>-<random>`. The pid in
the name is what lets a later run recognise a folder left behind by a process that died without cleaning
up (a crash, a kill): at start, folders of this form whose process no longer exists are removed.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

from shardspeed.config import ConfigError

__all__ = ["SwapFolder", "check_nvme_path", "remove_stale_folders"]

PREFIX = "shardspeed-swap-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


def check_nvme_path(path: str | None, bytes_needed: int, key: str) -> Path:
    """`path` must be (or be creatable as) a writable directory with at least `bytes_needed` free; a
    ConfigError naming `key`, the path and the bytes otherwise. Stale swap folders there are removed first (they count as free)."""
    if not path:
        raise ConfigError(f"{key}: required for NVMe offload (a directory on a fast local disk)")
    folder = Path(path)
    if not folder.exists():
        try:  # created when missing, as DeepSpeed does; ranks sharing the path race here
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"{key}: {path!r} does not exist and cannot be created ({error.strerror or error}); "
                f"NVMe offload needs {bytes_needed:,} bytes there"
            ) from error
    if not folder.is_dir():
        raise ConfigError(
            f"{key}: {path!r} is not a directory (NVMe offload needs {bytes_needed:,} bytes there)"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}: {path!r} is not writable (NVMe offload needs {bytes_needed:,} bytes there)"
        )
    remove_stale_folders(folder)
    free = shutil.disk_usage(folder).free
    if free < bytes_needed:
        raise ConfigError(
            f"{key}: {path!r} has {free:,} bytes free, NVMe offload needs {bytes_needed:,} bytes "
            f"({bytes_needed - free:,} more)"
        )
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_folders(folder: Path) -> list[Path]:
    """Remove swap folders in `folder` whose creating process is gone; returns what was removed."""
    removed = []
    for entry in folder.iterdir() if folder.is_dir() else []:
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


class SwapFolder:
    """This rank's folder of swap files (`file(name)`), deleted by `close()` or at interpreter exit."""

    def __init__(self, nvme_path: str, what: str, rank: int, bytes_needed: int, key: str):
        base = check_nvme_path(nvme_path, bytes_needed, key)
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{what}-rank{rank}-", dir=base))
        except OSError as error:
            raise ConfigError(f"{key}: cannot create a swap folder in {nvme_path!r} ({error})") from error
        atexit.register(self.close)

    def file(self, name: str) -> str:
        return str(self.path / name)

    def disk_bytes(self) -> int:
        if not self.path.exists():
            return 0
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
