"""Per-parameter universal-checkpoint metadata of AutoTP layers (`param.ds_autotp_universal_checkpoint_meta`).

Every parameter an AutoTP layer splits (or keeps whole on purpose, like a row-parallel bias) carries one dict
with two readers:

- its top level is for *restoring*: how this rank's slice is cut out of the whole value
  (checkpoint/tp_restore.py) — `partition_dim`, the whole `logical_shape`, the fused parts' `sub_param_sizes`
  and their per-rank `sub_param_shard_widths`, the per-rank `partition_sizes`, this rank's
  `target_partition_shape`, `replicated`;
- its `conversion` entry is for *converting*: what `universal_checkpoint_info` publishes for the whole model
  (module_inject/tp_state.py) — the partition type and dimension, the fused parts' shape spec and widths,
  `unsupported_reason` for a layout that cannot be merged.

Keeping both views in one object (rather than re-deriving either) is what makes the converter and the loader
agree on how a parameter was cut. The keys and the version (0.4: widths recorded) are DeepSpeed 0.19.8's.
"""

from __future__ import annotations

__all__ = [
    "AUTOTP_META_ATTR",
    "UC_VERSION",
    "build_param_uc_restore_meta",
    "even_split",
    "param_uc_conversion_meta",
    "set_param_uc_meta",
    "subparam_shard_widths",
]

AUTOTP_META_ATTR = "ds_autotp_universal_checkpoint_meta"
UC_VERSION = 0.4


def _shape(value):
    """A shape-like value as a tuple (nested tuples kept as tuples); None stays None."""
    if value is None or isinstance(value, int):
        return value
    return tuple(_shape(v) if isinstance(v, (list, tuple)) else int(v) for v in value)


def even_split(size: int, tp_size: int) -> list[int]:
    """Each rank's share of `size`: equal, the remainder one each on the lowest ranks (10 over 4: 3, 3, 2, 2)."""
    return [size // tp_size + (1 if rank < size % tp_size else 0) for rank in range(tp_size)]


def subparam_shard_widths(subparam_sizes, tp_world_size: int, meta=None, name=None) -> list[list[int]]:
    """Per fused part, each rank's width of it ([[q widths], [k widths], [v widths]]). A part narrower than the
    tensor degree (fewer key/value heads than ranks) leaves some ranks a width of 0. `meta` and `name`
    (DeepSpeed's head-count hints) are not used: shardspeed splits each part evenly in elements."""
    del meta, name
    return [even_split(int(size), tp_world_size) for size in subparam_sizes]


def _conversion_meta(*, partition_type, partition_dim, sub_param_shape, sub_param_shard_widths, original_shape,
                     is_bias, replicated, unsupported_reason) -> dict:  # fmt: skip
    return {
        "partition_type": partition_type,
        "partition_dim": partition_dim,
        "sub_param_shape": _shape(sub_param_shape),
        "sub_param_shard_widths": sub_param_shard_widths,
        "original_shape": _shape(original_shape),
        "is_bias": is_bias,
        "replicated": replicated,
        "unsupported_reason": unsupported_reason,
    }


def build_param_uc_restore_meta(*, partition_type, partition_dim=None, logical_shape=None, output_shape=None,
                                sub_param_shape=None, sub_param_sizes=None, sub_param_shard_widths=None,
                                partition_sizes=None, target_partition_shape=None, original_shape=None,
                                is_bias=False, replicated=False, affine_map=None,
                                unsupported_reason=None) -> dict:  # fmt: skip
    """The metadata dict of one parameter (shapes as tuples), its conversion view nested under `conversion`.
    `affine_map` (DeepSpeed's geometric layout records) is refused: shardspeed's layers have none."""
    if affine_map is not None:
        raise ValueError("affine_map: AutoTP affine-map layouts are not supported by shardspeed")
    return {
        "universal_checkpoint_version": UC_VERSION,
        "partition_type": partition_type,
        "partition_dim": partition_dim,
        "logical_shape": _shape(logical_shape),
        "output_shape": _shape(output_shape),
        "sub_param_shape": _shape(sub_param_shape),
        "sub_param_sizes": _shape(sub_param_sizes),
        "sub_param_shard_widths": sub_param_shard_widths,
        "partition_sizes": _shape(partition_sizes),
        "target_partition_shape": _shape(target_partition_shape),
        "original_shape": _shape(original_shape),
        "is_bias": is_bias,
        "replicated": replicated,
        "conversion": _conversion_meta(
            partition_type=partition_type,
            partition_dim=partition_dim,
            sub_param_shape=sub_param_shape,
            sub_param_shard_widths=sub_param_shard_widths,
            original_shape=original_shape,
            is_bias=is_bias,
            replicated=replicated,
            unsupported_reason=unsupported_reason,
        ),
    }


def set_param_uc_meta(param, **fields) -> None:
    """Attach `build_param_uc_restore_meta(**fields)` to `param` (None: nothing to describe)."""
    if param is not None:
        setattr(param, AUTOTP_META_ATTR, build_param_uc_restore_meta(**fields))


def param_uc_conversion_meta(param):
    """The conversion view of `param`'s metadata, or None for a parameter AutoTP did not mark."""
    meta = getattr(param, AUTOTP_META_ATTR, None)
    return meta.get("conversion") if meta else None
