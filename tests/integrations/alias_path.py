"""Make the `deepspeed` alias package importable without installing it (for tests and benchmarks).

`stage_alias(folder)` puts into `folder` what `pip install ./integrations/deepspeed-alias` would put into
site-packages: the `deepspeed` package (a symlink to the source) and a `deepspeed-<version>.dist-info` with
the metadata that Transformers, Accelerate and Lightning read to decide that DeepSpeed is installed. Put
`folder` first on PYTHONPATH of the processes that should see it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALIAS_SOURCE = ROOT / "integrations" / "deepspeed-alias"


def alias_version() -> str:
    text = (ALIAS_SOURCE / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1)


def stage_alias(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    package = folder / "deepspeed"
    if not package.exists():
        os.symlink(ALIAS_SOURCE / "deepspeed", package, target_is_directory=True)
    version = alias_version()
    info = folder / f"deepspeed-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    (info / "top_level.txt").write_text("deepspeed\n")
    return folder


def env_with_alias(folder: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default: os.environ) whose PYTHONPATH starts with the staged alias."""
    env = dict(os.environ if base is None else base)
    parts = [str(stage_alias(folder)), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return env
