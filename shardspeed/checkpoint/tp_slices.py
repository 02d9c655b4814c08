"""Merging tensor-parallel slices into whole universal values, by DeepSpeed's `universal_checkpoint_info` rules.

A tensor-parallel checkpoint (DeepSpeed's AutoTP or Megatron-DeepSpeed, or one of ours described the same way)
holds one slice of each parameter per tensor rank. How the slices go back together is written in the
checkpoint's `universal_checkpoint_info`, by regular-expression patterns over parameter names:

- `tp_replicated_parameter_patterns`: every rank holds the whole value (norms, row-parallel biases): keep one,
  after checking the copies agree;
- `parameter_to_average_patterns`: the mean of the slices;
- `parameter_with_row_parallelism_patterns`: concatenated along dim 1 (input features); everything else along
  dim 0 (output features);
- `parameter_with_2_sub_params_cat_dim_0`: two equal halves ([gate; up]) merged separately;
- `parameter_with_sub_params`: fused parts (`[q; k; v]`) merged part by part, with each rank's width of each
  part in `sub_param_shard_widths` (version 0.4 on: uneven GQA splits), or, in older metadata, an even split
  of `shape[partition_dim]` parts (a count) or part sizes (a tuple);
- `vocabulary_parameter_patterns`: padding rows beyond `original_vocab_size` are cut off.

`merge_rank_slices` applies them to tensors in memory; `merge_tp_slices` (DeepSpeed's name) is the same rule
over DeepSpeed's intermediate fragment files (`<slices>/<name>/<tp rank>/<state>.<dp rank>`, the layout its
converter extracts ZeRO partitions into), writing `<out>/<name>/<state>.pt`. `merge_zero_shards` reads one
state's fragments per tensor rank; `group_per_tp_shapes` sorts the per-file parameter shapes of a
pipeline x tensor checkpoint by tensor rank. DeepSpeed's `affine_map` (written beside the lists) is not read:
a parameter it cuts into several pieces per rank without a sub-parameter entry is refused by name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "SubparamShape",
    "group_per_tp_shapes",
    "merge_rank_slices",
    "merge_tp_slices",
    "merge_zero_shards",
    "resolve_logical_shape",
]

# DeepSpeed 0.19.8's keys (deepspeed/checkpoint/constants.py), spelled here so the library needs no compat import
PARAM, CAT_DIM, SUB_PARAM_SHAPE, PARAM_N_SUB_PARAMS, VOCAB_TENSOR = (
    "param",
    "cat_dim",
    "sub_param_shape",
    "param_n_sub_params",
    "vocab_tensor",
)
REPLICATED = "tp_replicated_parameter_patterns"
AVERAGED = "parameter_to_average_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
VOCABULARY = "vocabulary_parameter_patterns"
TWO_SUB_PARAMS = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
SHARD_WIDTHS = "sub_param_shard_widths"
VERSION = "universal_checkpoint_version"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
AFFINE_MAP = "affine_map"
# the version from which every sub-parameter entry records its per-rank widths
WIDTHS_VERSION = 0.4
MERGED_STATES = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass
class SubparamShape:
    """One `parameter_with_sub_params` entry: the parameters it names, their shape with the fused dimension
    given as the parts' sizes (a tuple) or, in metadata older than 0.4, their count, and that dimension."""

    patterns: list
    shape: tuple
    partition_dim: int


class _Rules:
    """The `universal_checkpoint_info` patterns, with the ones no parameter matched remembered (DeepSpeed's
    converter reports them: a pattern that matches nothing usually names a parameter that was renamed)."""

    def __init__(self, info: dict):
        affine = info.get(AFFINE_MAP) or {}
        if affine and int(affine.get("version", 1)) > 1:
            raise ValueError(f"universal_checkpoint_info.{AFFINE_MAP}: version {affine['version']} is newer than "
                             "the version 1 shardspeed reads")  # fmt: skip
        self.affine = affine.get("params") or {}
        self.info = info
        self.sub_params = [SubparamShape(**entry) for entry in info.get(SUB_PARAMS, [])]
        self.version = float(info.get(VERSION, 0.0))
        self.unmatched = {p for key in (REPLICATED, AVERAGED, ROW_PARALLEL, VOCABULARY, TWO_SUB_PARAMS)
                          for p in info.get(key, [])}  # fmt: skip
        self.unmatched.update(p for entry in self.sub_params for p in entry.patterns)

    def match(self, key: str, name: str) -> str | None:
        found = [p for p in self.info.get(key, []) if re.match(p, name)]
        if len(found) > 1:
            raise AssertionError(f"{name} matches more than one of the {key}: {found}")
        if found:
            self.unmatched.discard(found[0])
        return found[0] if found else None

    def check_affine(self, name: str) -> None:
        """DeepSpeed 0.19.8 publishes an affine map (each rank's pieces of the whole value) beside the pattern
        lists, which it keeps for converters that do not read maps. The lists describe a parameter held as one
        block per rank, or fused parts listed as sub-parameters; a map cutting a rank's shard into several
        pieces of anything else describes a layout only the map knows, which is refused by name."""
        for pattern, layout in self.affine.items():
            if not re.match(pattern, name):
                continue
            ranks = (layout or {}).get("ranks", {})
            pieced = any(len(r.get("pieces", [])) > 1 for r in ranks.values())
            if pieced and self.match_sub_params(name)[0] is None:
                raise ValueError(
                    f"{name}: its layout is described only by DeepSpeed's {AFFINE_MAP} (several pieces per "
                    "rank, no sub-parameter entry), which shardspeed's converter does not read"
                )

    def match_sub_params(self, name: str):
        for entry in self.sub_params:
            for pattern in entry.patterns:
                if re.match(pattern, name):
                    self.unmatched.discard(pattern)
                    return entry, pattern
        return None, None


def resolve_logical_shape(shape, numel: int, name: str) -> list:
    """`shape` with its one `-1` placeholder (if any) replaced by the size `numel` elements give it."""
    holes = [i for i, d in enumerate(shape) if d is not None and d < 0]
    if not holes:
        return list(shape)
    assert len(holes) == 1, f"shape {list(shape)} of {name} has {len(holes)} placeholder dimensions"
    known = math.prod(d for i, d in enumerate(shape) if i != holes[0])
    assert known > 0 and numel % known == 0, f"shape {list(shape)} of {name} does not fit {numel} elements"
    resolved = list(shape)
    resolved[holes[0]] = numel // known
    return resolved


def _sub_param_layout(
    entry: SubparamShape, slices, tp: int, version: float, widths_by_pattern, pattern, name
):
    """(part sizes, per-part per-rank widths, the shape entry to record) of a fused parameter."""
    dim = entry.partition_dim
    spec = entry.shape[dim]
    if version >= WIDTHS_VERSION:
        # The widths depend on head counts that live in the model's config, not in the checkpoint: a version
        # that promises them but lacks them is inconsistent, and an even split would reshuffle a GQA weight.
        assert pattern in widths_by_pattern, (
            f"universal checkpoint version {version} records no {SHARD_WIDTHS} for {name} (pattern {pattern})"
        )
        sizes = tuple(spec) if isinstance(spec, (list, tuple)) else (spec,)
        return sizes, [list(w) for w in widths_by_pattern[pattern]], entry
    if isinstance(spec, (list, tuple)):
        sizes = tuple(spec)
    else:  # older metadata: the number of equal parts (`(3, -1)` for q, k, v)
        assert all(s.dim() > dim for s in slices), f"legacy sub-parameter count of {name} needs shaped slices"
        total = sum(s.shape[dim] for s in slices)
        assert spec > 0 and total % spec == 0, (
            f"{spec} parts do not divide {name}'s dimension {dim} ({total})"
        )
        sizes = (total // spec,) * spec
        shape = list(entry.shape)
        shape[dim] = sizes
        entry = SubparamShape(patterns=entry.patterns, shape=tuple(shape), partition_dim=dim)
    uneven = [s for s in sizes if s % tp]
    assert not uneven, (
        f"sub-parameter sizes {uneven} of {name} are not divisible by tp_degree {tp}, and version {version} "
        f"predates {SHARD_WIDTHS}: the uneven layout cannot be reconstructed"
    )
    return sizes, [[s // tp] * tp for s in sizes], entry


def _merge_sub_params(entry, slices, tp, version, widths_by_pattern, pattern, name):
    sizes, widths, recorded = _sub_param_layout(entry, slices, tp, version, widths_by_pattern, pattern, name)
    dim = entry.partition_dim
    assert len(widths) == len(sizes), f"{len(widths)} width entries for {len(sizes)} sub-parameters of {name}"
    for size, per_rank in zip(sizes, widths):
        assert len(per_rank) == tp, f"{name}: widths {per_rank} of a part of {size} are not one per tp rank"
        assert sum(per_rank) == size, f"{name}: widths {per_rank} sum to {sum(per_rank)}, expected {size}"
    shape = [sum(d) if isinstance(d, (list, tuple)) else d for d in entry.shape]
    shape[dim] = sum(sizes)
    # resolved from the whole parameter: a rank holding none of it has an empty slice that fits any -1
    shape = resolve_logical_shape(shape, sum(s.numel() for s in slices), name)
    views = []
    for rank, piece in enumerate(slices):
        rank_shape = list(shape)
        rank_shape[dim] = sum(w[rank] for w in widths)
        assert math.prod(rank_shape) == piece.numel(), (
            f"tp rank {rank} of {name} holds {piece.numel()} elements, its widths describe {tuple(rank_shape)}"
        )
        views.append(piece.reshape(rank_shape))
    offsets, parts = [0] * tp, []
    for per_rank in widths:  # part by part: every rank's piece of it, in rank order
        parts.append(
            torch.cat([v.narrow(dim, offsets[r], per_rank[r]) for r, v in enumerate(views)], dim=dim)
        )
        offsets = [o + w for o, w in zip(offsets, per_rank)]
    return torch.cat(parts, dim=dim), {SUB_PARAM_SHAPE: recorded}


def merge_rank_slices(info: dict, name: str, slices: list, tp_degree: int, rules: _Rules | None = None):
    """(whole value, extra entries of its universal file) of parameter `name` from its per-rank `slices`,
    by `info`'s rules; None where there is nothing to merge (no slices: ZeRO keeps no optimizer state for a
    parameter that never had a gradient)."""
    rules = rules or _Rules(info)
    rules.check_affine(name)
    extra = {}
    sub_entry, sub_pattern = rules.match_sub_params(name)
    if rules.match(REPLICATED, name):
        for other in slices[1:]:
            assert slices[0].equal(other), f"the tensor-replicated copies of {name} differ between ranks"
        value = slices[0]
    elif rules.match(AVERAGED, name):
        value = sum(slices) / len(slices)
    elif rules.match(TWO_SUB_PARAMS, name):
        halves = [s.chunk(2, dim=0) for s in slices]
        value = torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
        extra = {CAT_DIM: 0, PARAM_N_SUB_PARAMS: 2}
    elif sub_entry is not None:
        widths = info.get(SHARD_WIDTHS, {})
        value, extra = _merge_sub_params(
            sub_entry, slices, tp_degree, rules.version, widths, sub_pattern, name
        )
    elif not slices:
        return None
    else:
        cat_dim = 1 if rules.match(ROW_PARALLEL, name) else 0
        value, extra = torch.cat(slices, dim=cat_dim), {CAT_DIM: cat_dim}
    if rules.match(VOCABULARY, name):
        value = value[: info[ORIGINAL_VOCAB_SIZE]]  # the padding rows are the target degree's to add back
        extra[VOCAB_TENSOR] = True
    return value, extra


def _fragment_paths(rank_dir: Path, state: str) -> list[Path]:
    """`<state>.<dp>` files of one tensor rank, in data-parallel order."""
    found = {}
    for path in rank_dir.glob(f"{state}.*"):
        suffix = path.name[len(state) + 1 :]
        if not suffix.isdigit():
            raise ValueError(f"cannot read a data-parallel rank from {path}")
        found[int(suffix)] = path
    return [found[i] for i in sorted(found)]


def merge_zero_shards(param_base_path, state: str, tp_degree: int, slice_shapes=None) -> list:
    """One tensor slice per tensor rank of one parameter's `state`: each rank's data-parallel fragments joined
    (and shaped by `slice_shapes[rank]` when given). A rank that owned none of the parameter wrote no
    fragment; with shapes given it gets an empty slice in its place, so later ranks keep their position —
    but only where its recorded shape is empty (otherwise fragments were lost). `step` gives the common
    value of the fragments."""
    slices, missing = [], []
    for rank in range(tp_degree):
        paths = _fragment_paths(Path(param_base_path) / str(rank), state)
        if not paths:
            missing.append((rank, len(slices)))
            continue
        fragments = [torch.load(p, weights_only=False) for p in paths]
        if state == "step":
            assert all(f == fragments[0] for f in fragments), "the fragments disagree on the step"
            slices.append(fragments[0])
            continue
        joined = torch.cat(fragments, dim=0)
        slices.append(joined if slice_shapes is None else joined.reshape(slice_shapes[rank]))
    if missing and slice_shapes is not None and slices and torch.is_tensor(slices[0]):
        for rank, position in reversed(missing):
            shape = tuple(slice_shapes[rank])
            assert math.prod(shape) == 0, (
                f"no fragment files for tp rank {rank} of a parameter whose recorded shape {shape} is not empty"
            )
            slices.insert(position, torch.empty(shape, dtype=slices[0].dtype))
    return slices


def merge_tp_slices(uc_info: dict, dir, slice_dir, tp_degree: int, name_and_shapes) -> set:
    """Merge one parameter's fragment files (`slice_dir/<name>/<tp rank>/<state>.<dp rank>`) into
    `dir/<name>/<state>.pt` (DeepSpeed's universal files: `{"param": value, ...}`; `step.pt` the step).
    `name_and_shapes` is `(name, per-rank shapes)`. Returns the patterns of `uc_info` this parameter did not
    match (DeepSpeed's converter intersects them over all parameters)."""
    name, shapes = name_and_shapes
    rules = _Rules(uc_info)
    source, target = Path(slice_dir) / name, Path(dir) / name
    step = merge_zero_shards(source, "step", tp_degree, shapes)
    if step:
        target.mkdir(parents=True, exist_ok=True)
        torch.save(step[0], target / "step.pt")
    for state in MERGED_STATES:
        merged = merge_rank_slices(uc_info, name, merge_zero_shards(source, state, tp_degree, shapes),
                                   tp_degree, rules)  # fmt: skip
        if merged is None:
            continue
        value, extra = merged
        target.mkdir(parents=True, exist_ok=True)
        torch.save({**extra, PARAM: value}, target / f"{state}.pt")
    return rules.unmatched


def group_per_tp_shapes(slice_shapes_by_tp: list, pp_degree: int, tp_degree: int) -> dict:
    """{name: [shape on tp rank 0, 1, ...]} from the `param_shapes` of each model-states file, listed
    pipeline-major (file i is stage i // tp_degree, tensor rank i % tp_degree, as DeepSpeed numbers
    `mp_rank_XX`). Stages are unioned per tensor rank (a parameter of one stage only is kept, None elsewhere);
    a parameter stored by several stages (tied) must have one shape on each."""
    per_rank = []
    for tp in range(tp_degree):
        shapes = {}
        for pp in range(pp_degree):
            stage = slice_shapes_by_tp[pp * tp_degree + tp]
            for name in shapes.keys() & stage.keys():
                assert shapes[name] == stage[name], (
                    f"Pipeline replicas of {name} on tp rank {tp} disagree on shape: {shapes[name]} vs {stage[name]}"
                )
            shapes.update(stage)
        per_rank.append(shapes)
    names = set().union(*per_rank) if per_rank else set()
    return {name: [shapes.get(name) for shapes in per_rank] for name in names}
