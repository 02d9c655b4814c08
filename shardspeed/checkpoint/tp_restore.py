"""This tensor rank's slice of a whole universal value, from the parameter's AutoTP restore metadata (the
inverse of checkpoint/tp_slices.py), and DeepSpeed's per-parameter loader `load_hp_checkpoint_state`.

An AutoTP parameter carries `ds_autotp_universal_checkpoint_meta` (module_inject/tp_uc_meta.py builds it):
at the top level what a restore needs (`partition_dim`, `logical_shape`, the fused parts' `sub_param_sizes`
and their per-rank `sub_param_shard_widths`, uneven `partition_sizes`, `replicated`), and under `conversion`
what the converter publishes. `resolve_autotp_partition` cuts rank `tp_rank`'s slice out of the whole value
by it; layouts that cannot be described (interleaved fused weights) carry an `unsupported_reason` and are
refused, as conversion refuses them, rather than restored as contiguous slices.

`load_hp_checkpoint_state(param, folder, tp_rank, tp_world_size)` is DeepSpeed's method of a ZeRO parameter
with a high-precision mapping (`param._hp_mapping`: `lp_fragment_address`, `get_hp_fragment()`,
`optim_fragment`): it reads a universal parameter folder (`fp32.pt`, `exp_avg.pt`, ..., `step.pt`), takes
this rank's slice of each state and this partition's fragment of it. shardspeed's own engines restore
universal folders by name (checkpoint/universal_folder.py); this function serves code written against
DeepSpeed's hp mapping.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "AUTOTP_META_ATTR",
    "load_hp_checkpoint_state",
    "narrow_sub_params",
    "param_uc_restore_meta",
    "resolve_autotp_partition",
]

AUTOTP_META_ATTR = "ds_autotp_universal_checkpoint_meta"  # DeepSpeed's DS_AUTOTP_UC_META
_VERSION = "universal_checkpoint_version"
_WIDTHS_VERSION = 0.4  # from this version on the metadata records each part's per-rank widths
_PARAM, _CAT_DIM, _SUB_PARAM_SHAPE, _N_SUB_PARAMS, _VOCAB_TENSOR = (
    "param",
    "cat_dim",
    "sub_param_shape",
    "param_n_sub_params",
    "vocab_tensor",
)
_IS_EXPERT, _NUM_EXPERTS = "is_expert_param", "ep_num_experts"


def param_uc_restore_meta(param):
    """The restore view of a parameter's AutoTP metadata (the dict itself: its top level is what a restore
    reads, its `conversion` entry what the converter publishes), or None for a parameter AutoTP left alone."""
    return getattr(param, AUTOTP_META_ATTR, None)


def narrow_sub_params(
    full_view, partition_dim, sub_dim_sizes, shard_widths, tp_rank, tp_world_size, uc_version
):
    """Rank `tp_rank`'s piece of every fused part of `full_view` along `partition_dim`, joined, flattened.
    `shard_widths[part][rank]` is each rank's width of each part (uneven for GQA); metadata older than 0.4 has
    none and can only describe an even split, so an uneven part is refused there."""
    assert sum(sub_dim_sizes) == full_view.shape[partition_dim], (
        f"sub-parameter sizes {list(sub_dim_sizes)} sum to {sum(sub_dim_sizes)}, but dimension {partition_dim} "
        f"of the parameter is {full_view.shape[partition_dim]}: the metadata describes another parameter"
    )
    if uc_version < _WIDTHS_VERSION:
        uneven = [size for size in sub_dim_sizes if size % tp_world_size]
        assert not uneven, (
            f"sub-parameter sizes {uneven} are not divisible by tp_world_size {tp_world_size}, and this metadata "
            "records no sub_param_shard_widths: its uneven layout cannot be reconstructed"
        )
        shard_widths = [[size // tp_world_size] * tp_world_size for size in sub_dim_sizes]
    assert len(shard_widths) == len(sub_dim_sizes), (
        f"{len(shard_widths)} shard width entries for {len(sub_dim_sizes)} sub-parameters"
    )
    pieces, offset = [], 0
    for size, widths in zip(sub_dim_sizes, shard_widths):
        assert len(widths) == tp_world_size, (
            f"widths {list(widths)} are not one per tp rank ({tp_world_size})"
        )
        assert sum(widths) == size, f"widths {list(widths)} sum to {sum(widths)}, expected {size}"
        pieces.append(full_view.narrow(partition_dim, offset + sum(widths[:tp_rank]), widths[tp_rank]))
        offset += size
    return torch.cat(pieces, dim=partition_dim).flatten()


def _sub_dim_sizes(meta: dict, partition_dim):
    """(part sizes or None, partition dim): `sub_param_sizes` when recorded (the physical widths), else the
    `sub_param_shape` entry at the partition dim (older metadata; a `(3, -1)` view spec's 3 is a count, so
    `sub_param_sizes` wins whenever both are there)."""
    if meta.get("sub_param_sizes") is not None:
        sizes = meta["sub_param_sizes"]
    elif meta.get("sub_param_shape") is not None:
        spec = meta["sub_param_shape"]
        if hasattr(spec, "shape") and hasattr(spec, "partition_dim"):  # a SubparamShape record
            spec, partition_dim = spec.shape, spec.partition_dim
        sizes = spec[partition_dim]
    else:
        return None, partition_dim
    return (tuple(sizes) if isinstance(sizes, (list, tuple)) else (sizes,)), partition_dim


def resolve_autotp_partition(
    current_param, ckpt_dict, full_hp_param, tp_rank, tp_world_size, state_key="fp32"
):
    """Rank `tp_rank`'s slice (flat) of `full_hp_param` by `current_param`'s AutoTP restore metadata; None when
    the parameter has none or it describes no split (the caller then splits by the file's `cat_dim`)."""
    meta = param_uc_restore_meta(current_param)
    if not meta:
        return None
    conversion = meta.get("conversion") or {}
    if conversion.get("unsupported_reason"):
        raise RuntimeError(
            f"Cannot restore a universal checkpoint into this AutoTP parameter: {conversion['unsupported_reason']}"
        )
    if conversion.get("affine_map") is not None:
        raise RuntimeError("AutoTP affine-map layouts are not supported by shardspeed's universal restore")
    partition_dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        assert partition_dim is None, "a replicated parameter has no partition dimension"
        return full_hp_param.flatten()
    if partition_dim is None or meta.get("logical_shape") is None:
        return None
    full_view = full_hp_param.view(tuple(meta["logical_shape"]))
    sizes, partition_dim = _sub_dim_sizes(meta, partition_dim)
    if sizes is not None:
        version = float(meta.get(_VERSION, 0.0))
        widths = meta.get("sub_param_shard_widths")
        return narrow_sub_params(full_view, partition_dim, sizes, widths, tp_rank, tp_world_size, version)
    if meta.get("partition_sizes") is not None:
        sizes = meta["partition_sizes"]
        return full_view.narrow(partition_dim, sum(sizes[:tp_rank]), sizes[tp_rank]).flatten()
    # AutoTP gives the remainder of an uneven split to the low ranks ([3, 3, 2, 2] for 10 over 4) where
    # torch.chunk would give [3, 3, 3, 1]: without recorded sizes only an even split can be trusted.
    size = full_view.shape[partition_dim]
    assert size % tp_world_size == 0, (
        f"Dimension {partition_dim} of size {size} is not divisible by tp_world_size {tp_world_size}, and this "
        "checkpoint records no partition_sizes: its uneven layout cannot be reconstructed"
    )
    return full_view.chunk(tp_world_size, dim=partition_dim)[tp_rank].flatten()


def _legacy_slice(
    ckpt_dict: dict, full: torch.Tensor, tp_rank: int, tp_world_size: int, path
) -> torch.Tensor:
    """This rank's slice by the universal file's own entries (no AutoTP metadata on the parameter): fused
    parts (`sub_param_shape`), n equal parts (`param_n_sub_params`), else an even split along `cat_dim`."""
    sub_shape = ckpt_dict.get(_SUB_PARAM_SHAPE)
    dim = ckpt_dict.get(_CAT_DIM, 0)
    n_parts = ckpt_dict.get(_N_SUB_PARAMS, 1)
    if sub_shape:
        dim = sub_shape.partition_dim
        sizes = sub_shape.shape[dim]
        sizes = tuple(sizes) if isinstance(sizes, (list, tuple)) else (sizes,)
        full = full.view([sum(d) if isinstance(d, (list, tuple)) else d for d in sub_shape.shape])
        parts = full.split(list(sizes), dim=dim)
        return torch.cat([p.chunk(tp_world_size, dim=dim)[tp_rank] for p in parts], dim=dim).flatten()
    if n_parts > 1:
        parts = full.chunk(n_parts, dim=dim)
        return torch.cat([p.chunk(tp_world_size, dim=dim)[tp_rank] for p in parts], dim=dim).flatten()
    return full.chunk(tp_world_size, dim)[tp_rank].flatten()


def load_hp_checkpoint_state(self, folder, tp_rank, tp_world_size, ep_rank=0, ep_size=1):
    """Load this parameter's universal folder into its high-precision fragment and optimizer fragments
    (`self._hp_mapping`); returns the folder's `step` (None without a `step.pt`). Bound to a parameter as a
    method, as DeepSpeed's `enable_universal_checkpoint` does."""
    mapping = getattr(self, "_hp_mapping", None)
    if mapping is None:
        raise AttributeError(
            "load_hp_checkpoint_state needs a parameter with a high-precision mapping (`_hp_mapping`, "
            "DeepSpeed's ZeRO 1/2 and BF16 optimizers link one); shardspeed's engines load universal folders "
            "by name (engine.load_checkpoint with checkpoint.load_universal)"
        )
    mapping.optim_fragment = {}
    has_meta = param_uc_restore_meta(self) is not None
    step = None
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".pt"):
            continue
        key, path = file[: -len(".pt")], os.path.join(folder, file)
        ckpt_dict = torch.load(path, weights_only=False)
        if key == "step":
            step = ckpt_dict
            continue
        full = ckpt_dict[_PARAM]
        rank, world = tp_rank, tp_world_size
        is_expert = ckpt_dict.get(_IS_EXPERT, False)
        if is_expert and ep_size > 1:  # expert-parallel: this rank's experts, contiguous along dim 0
            experts = ckpt_dict.get(_NUM_EXPERTS)
            assert experts is not None, f"expert parameter in {path} records no {_NUM_EXPERTS}"
            assert full.shape[0] == experts and experts % ep_size == 0, (
                f"{path}: {experts} experts on dim 0 of {tuple(full.shape)} do not split over ep_size {ep_size}"
            )
            local = experts // ep_size
            full = full[ep_rank * local : (ep_rank + 1) * local]
        # A whole value the size of this rank's parameter is one every rank held in full (averaged or
        # replicated); AutoTP metadata, though, pins the slice even where one rank owns everything (MQA).
        if full.shape == self.shape and not has_meta:
            rank, world = 0, 1
        if ckpt_dict.get(_VOCAB_TENSOR, False) and not is_expert and not has_meta:
            # the converter strips the vocabulary padding; the target degree's padding goes back on
            padded = self.shape[0] * world
            assert padded >= full.shape[0], (
                f"vocabulary padded size {padded} < universal size {full.shape[0]}"
            )
            full = torch.nn.functional.pad(full, (0, 0, 0, padded - full.shape[0]))
        tp_slice = resolve_autotp_partition(self, ckpt_dict, full, rank, world, state_key=key)
        if tp_slice is None:
            assert full.numel() == world * self.numel(), (
                f"Loading {path}: whole numel {full.numel()} != slice numel {self.numel()} * tp_world_size {world}"
            )
            tp_slice = _legacy_slice(ckpt_dict, full, rank, world, path)
        address = mapping.lp_fragment_address
        fragment = tp_slice.narrow(0, address.start, address.numel)
        if key == "fp32":
            target = mapping.get_hp_fragment()
            assert target.numel() == address.numel, f"{path}: fragment {target.numel()} != {address.numel}"
            target.data.copy_(fragment.data)
        else:
            mapping.optim_fragment[key] = fragment.clone().detach()
    return step
