"""Import-time stand-ins for DeepSpeed's Hugging Face adapters for Ulysses (`ulysses_sp`, ALST), not built yet.

Accelerate imports `UlyssesSPAttentionHF` and `UlyssesSPDataLoaderAdapter` only when a parallelism config
asks for `sp_size > 1`. The names exist so that such imports resolve; using them raises NotImplementedError
naming what is missing instead of an ImportError about a module path. Ulysses itself is built
(`shardspeed.sequence`): models that call `DistributedAttention` train with `sequence_parallel_size`.
"""

from __future__ import annotations

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

_MISSING = (
    "the Hugging Face Ulysses adapters (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter; Accelerate's "
    "sp_size > 1) are not implemented in shardspeed yet; train with sp_size 1, or wrap the model's attention "
    "in shardspeed.sequence.DistributedAttention and set sequence_parallel_size in the config"
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
