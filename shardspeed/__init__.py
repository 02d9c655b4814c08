"""shardspeed: DeepSpeed's training API and JSON config, in pure Python on PyTorch.

    import shardspeed as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")

Names are imported lazily (PEP 562): `import shardspeed` stays cheap for the launcher, which starts
processes and must not pay for importing torch first. Where each top-level name lives, and every DeepSpeed
import path that is not where shardspeed keeps it, is one table: shardspeed/compat/paths.py, applied to
imports and attribute access by shardspeed/compat/finder.py (so `deepspeed.runtime.pipe.PipelineModule`
works after a bare `import shardspeed as deepspeed`, as after `import deepspeed`).
"""

from __future__ import annotations

import warnings

from shardspeed import version as _version
from shardspeed.compat import finder as _finder
from shardspeed.compat.paths import PATHS as _PATHS

# torch warns at import when NumPy is absent; NumPy is optional for torch and unused by shardspeed, so a
# clean install would print a warning on every start. Targeted at that one message (it fires only when
# shardspeed is imported before torch, as the examples do).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

_finder.install()

__version__ = _version.__version__
# DeepSpeed's top level carries these too (its tests and some tools read them)
__version_major__, __version_minor__, __version_patch__ = (
    _version.__version_major__,
    _version.__version_minor__,
    _version.__version_patch__,
)
__git_hash__, __git_branch__ = _version.__git_hash__, _version.__git_branch__

# the public API: the top-level names the table maps (not its stand-ins), and the subpackages users reach for
__all__ = sorted(
    {name for name, target in _PATHS.items() if "." not in name and isinstance(target, str)}
    | {
        "accelerator",
        "checkpoint",
        "comm",
        "inference",
        "moe",
        "monitor",
        "ops",
        "pipe",
        "profiling",
        "runtime",
    }
    | {"checkpointing", "git_version_info", "utils", "zero", "__version__"}
)


def __getattr__(name: str):
    return _finder.attribute_of(_SELF, name)


def __dir__() -> list[str]:
    return __all__


_SELF = __import__("sys").modules[__name__]
