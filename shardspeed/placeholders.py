"""`deepspeed.tp_model_init`: DeepSpeed 0.19.8's AutoTP training entry point, kept for compatibility.

As in DeepSpeed, it only records its arguments on the model; `initialize` merges them into the config's
`tensor_parallel` block (a conflicting `autotp_size` is an error) and shards the model there.
"""

from __future__ import annotations

__all__ = ["tp_model_init"]


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """Record `tp_size` (and `dtype`, `config`) for `initialize`, which does the sharding. Returns `model`."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if kwargs.get("tp_group") is not None:
        raise ValueError(
            "tp_model_init(tp_group=...): pass the layout through the config's tensor_parallel block"
        )
    model._shardspeed_tp_model_init = {"tp_size": tp_size, "dtype": dtype, "config": config}
    return model
