"""Top-level DeepSpeed names whose features are not built yet: present so imports resolve, refusing on use.

Transformers reaches `deepspeed.tp_model_init` only when the config asks for AutoTP training
(`tensor_parallel.autotp_size > 1`). Calling it raises NotImplementedError naming the setting.
"""

from __future__ import annotations

__all__ = ["tp_model_init"]


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """DeepSpeed's AutoTP training entry point: not implemented yet."""
    raise NotImplementedError(
        f"tensor parallelism (tensor_parallel.autotp_size = {tp_size}) is not implemented in shardspeed yet; "
        f"set tensor_parallel.autotp_size to 1 (or remove it) to train with data parallelism and ZeRO"
    )
