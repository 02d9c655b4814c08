"""Import-time stand-ins for DeepSpeed's Ulysses sequence-parallel classes (`ulysses_sp`), not built yet.

Accelerate imports `UlyssesSPAttentionHF` and `UlyssesSPDataLoaderAdapter` only when a parallelism config
asks for `sp_size > 1`. The names exist so that such imports resolve; using them raises NotImplementedError
naming what is missing instead of an ImportError about a module path.
"""

from __future__ import annotations

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

_MISSING = (
    "Ulysses sequence parallelism (sp_size > 1) is not implemented in shardspeed yet; "
    "train with sp_size 1 (data parallelism and ZeRO)"
)


class UlyssesSPAttentionHF:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(_MISSING)

    @classmethod
    def register_with_transformers(cls, *args, **kwargs):
        raise NotImplementedError(_MISSING)


class UlyssesSPDataLoaderAdapter:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(_MISSING)
