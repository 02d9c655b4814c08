"""DeepSpeed's 3D checkpoint descriptors (`deepspeed.checkpoint.model_3d_desc`, `get_model_3d_descriptor`,
`ZeROCheckpoint`): how a checkpoint folder was parallelised, and which source ranks' files each rank of a
smaller layout merges.

A checkpoint folder written by P pipeline stages x T tensor ranks x D data ranks holds P*T model-states files
(`mp_rank_XX_model_states.pt`, one per model-parallel rank) and P*T*D ZeRO partition files
(`[bf16_|fp16_]zero_pp_rank_<D>_mp_rank_<XX>_optim_states.pt`). The degrees come from the files' names and
counts, or from the `checkpoint_parallel_dimensions` record (pp and tp degree) a model-states file carries,
which must then be in every model-states file and agree.

Reshaping only contracts (a target degree never exceeds the source's; expanding is refused): model-parallel
rank i of the source sits at (pp i // T, tp i % T); the tensor ranks of each stage are split evenly over the
target's tensor degree, then the stages of each tensor rank over the target's pipeline degree, and data
rank d's files are those of d's model-parallel ranks offset by d * P * T, split evenly over the target's data
degree. These are rank maps only: shardspeed merges and re-splits the tensors themselves by parameter name
(`CheckpointReader`, `TensorParallelReader`), so `ZeROCheckpoint.get_state_for_rank` (DeepSpeed's merged
partition layout) is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardspeed.checkpoint import files
from shardspeed.compat.mirrors.checkpoint_constants import (
    BF16_ZERO_FILE_PREFIX,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    FP16_ZERO_FILE_PREFIX,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    ZERO_FILE_PREFIX,
)
from shardspeed.compat.not_offered import NotOfferedError

__all__ = ["RankMap2D", "ZeROCheckpoint", "get_model_3d_descriptor", "model_3d_desc"]


def _split_evenly(items: list, parts: int) -> list[list]:
    if len(items) % parts:
        raise AssertionError(f"{len(items)} ranks do not split evenly into {parts}")
    size = len(items) // parts
    return [items[i : i + size] for i in range(0, len(items), size)]


class RankMap2D:
    """For each (pipeline index, tensor index) of a layout, the list of source indices it takes."""

    def __init__(self, pp_degree: int, tp_degree: int):
        self.pp_degree, self.tp_degree = pp_degree, tp_degree
        self.map: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def identity(cls, pp_degree: int, tp_degree: int) -> RankMap2D:
        grid = cls(pp_degree, tp_degree)
        for rank in range(pp_degree * tp_degree):
            grid.add_data(rank // tp_degree, rank % tp_degree, [rank])
        return grid

    def add_data(self, pp_index: int, tp_index: int, data: list) -> None:
        self._check(pp_index, tp_index)
        self.map.setdefault((pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The indices at (pp_index, tp_index); None for an index means every one of that axis, in order."""
        self._check(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [rank for p in pps for t in tps for rank in self.map.get((p, t), [])]

    def _check(self, pp_index, tp_index) -> None:
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise AssertionError(f"pipeline index {pp_index} outside degree {self.pp_degree}")
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise AssertionError(f"tensor index {tp_index} outside degree {self.tp_degree}")


def _contract_2d(source: RankMap2D, pp_degree: int, tp_degree: int) -> RankMap2D:
    """The tensor axis contracted first, then the pipeline axis (each split evenly, in order)."""
    by_tp = RankMap2D(source.pp_degree, tp_degree)
    for p in range(source.pp_degree):
        for t, ranks in enumerate(_split_evenly(source.get_data(pp_index=p), tp_degree)):
            by_tp.add_data(p, t, ranks)
    if pp_degree == source.pp_degree:
        return by_tp
    result = RankMap2D(pp_degree, tp_degree)
    for t in range(tp_degree):
        for p, ranks in enumerate(_split_evenly(by_tp.get_data(tp_index=t), pp_degree)):
            result.add_data(p, t, ranks)
    return result


class model_3d_desc:  # DeepSpeed's name
    """A layout of pp_degree x tp_degree x dp_degree ranks, and its contraction to a smaller one."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1):
        self.pp_degree, self.tp_degree, self.dp_degree = pp_degree, tp_degree, dp_degree

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def get_desc(self) -> str:
        return f"PP,TP,DP = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        errors = [
            f"{axis} indexing error: index {index} >= degree {degree}"
            for index, degree, axis in (
                (pp_index, self.pp_degree, "PP"),
                (tp_index, self.tp_degree, "TP"),
                (dp_index, self.dp_degree, "DP"),
            )
            if index >= degree
        ]
        return not errors, errors

    def can_reshape(self, target: model_3d_desc) -> tuple[bool, list[str]]:
        errors = [
            f"Expansion reshape not supported - {axis}: {ours} ---> {theirs}"
            for axis, ours, theirs in (
                ("PP", self.pp_degree, target.pp_degree),
                ("TP", self.tp_degree, target.tp_degree),
                ("DP", self.dp_degree, target.dp_degree),
            )
            if theirs > ours
        ]
        return not errors, errors

    def reshape(self, target: model_3d_desc, verbose: bool = False) -> list[RankMap2D]:
        """One map per target data rank: the source file indices each (pp, tp) rank of it merges."""
        ok, errors = self.can_reshape(target)
        if not ok:
            raise AssertionError(",".join(errors))
        grid = _contract_2d(
            RankMap2D.identity(self.pp_degree, self.tp_degree), target.pp_degree, target.tp_degree
        )
        model_parallel = self.pp_degree * self.tp_degree
        maps = [RankMap2D(target.pp_degree, target.tp_degree) for _ in range(target.dp_degree)]
        for p in range(target.pp_degree):
            for t in range(target.tp_degree):
                every_dp = [
                    i + d * model_parallel for i in grid.get_data(p, t) for d in range(self.dp_degree)
                ]
                for dp_map, ranks in zip(maps, _split_evenly(every_dp, target.dp_degree)):
                    dp_map.add_data(p, t, ranks)
        return maps


def _folder_files(folder) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


def _named(paths: list[Path], prefix: str) -> list[Path]:
    return sorted(p for p in paths if p.name.startswith(prefix))


def zero_files(folder) -> list[Path]:
    """The ZeRO partition files of a checkpoint folder, by (data rank, model-parallel rank)."""
    paths = _folder_files(folder)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = [p for p in _named(paths, prefix) if p.name.endswith("_optim_states.pt")]
        if found:
            pattern = re.compile(rf"{prefix}(\d+)_{MODEL_FILE_PREFIX}(\d+)")
            return sorted(found, key=lambda path: _ranks(path, pattern))
    return []


def _ranks(path: Path, pattern: re.Pattern) -> tuple[int, int]:
    """(data rank, model-parallel rank) of a ZeRO partition file."""
    match = pattern.search(path.name)
    if match is None:
        raise ValueError(f"Cannot parse dp_rank and mp_rank from {path}")
    return int(match.group(1)), int(match.group(2))


def _recorded_2d(model_files: list[Path]) -> tuple[int, int] | None:
    """(pp, tp) from the model-states files' `checkpoint_parallel_dimensions`, or None where none has it."""
    recorded, missing = [], []
    for path in model_files:
        dims = files.read_checkpoint(path).get(CHECKPOINT_PARALLEL_DIMS)
        if dims is None:
            missing.append(str(path))
            continue
        if not isinstance(dims, dict):
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {path}.")
        values = []
        for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
            value = dims.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RuntimeError(f"Checkpoint {key} must be a positive integer in {path}, got {value!r}.")
            values.append(value)
        recorded.append(tuple(values))
    if not recorded:
        return None
    if missing:
        raise RuntimeError(
            f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}"
        )
    if len(set(recorded)) != 1:
        raise RuntimeError(
            f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {recorded}"
        )
    return recorded[0]


def get_model_3d_descriptor(dir) -> model_3d_desc:  # `dir`: DeepSpeed's argument name
    """The layout a checkpoint folder was written by (see the module's notes)."""
    paths = _folder_files(dir)
    model_files, zeros = _named(paths, MODEL_FILE_PREFIX), zero_files(dir)
    if not model_files:  # DeepSpeed divides by their count here; a folder without any is not read
        raise RuntimeError(
            f"{dir} has no {MODEL_FILE_PREFIX}XX_model_states.pt files: not a checkpoint tag folder (or DeepSpeed's "
            "ZeRO-3 layout, whose model states are per data rank; its degrees are not described here)"
        )
    recorded = _recorded_2d(model_files)
    if recorded is not None:
        pp, tp = recorded
        if len(model_files) != pp * tp:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")  # fmt: skip
        if len(zeros) % (pp * tp):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zeros)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")  # fmt: skip
    else:  # no record: the first pipeline layer's files count the tensor ranks, else the model-states files do
        first_layer = len(_named(paths, f"{LAYER_FILE_PREFIX}01"))
        tp = first_layer or len(model_files)
        pp = len(model_files) // tp if first_layer else 1
    return model_3d_desc(pp, tp, max(1, len(zeros) // (pp * tp)))


class ZeROCheckpoint:
    """The ZeRO partition files of a checkpoint folder and its layout (DeepSpeed's class, descriptors and
    file maps; see the module's notes for `get_state_for_rank`)."""

    def __init__(self, dir, source_3d: model_3d_desc | None = None):
        if not Path(dir).is_dir():
            raise AssertionError(f"{dir} is not a folder")
        self.dir = dir
        self.file_list = [str(p) for p in zero_files(dir)]
        self.num_files = len(self.file_list)
        if not self.num_files:
            raise AssertionError(f"No ZeRO files found in {dir}")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d: model_3d_desc) -> None:
        self.target_3d = target_3d
        self._3d_file_map = self.src_3d.reshape(target_3d)

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        if dp_index >= len(self._3d_file_map):
            raise AssertionError(f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, *args, **kwargs):
        raise NotOfferedError(
            "ZeROCheckpoint.get_state_for_rank merges DeepSpeed's ZeRO partition layout (base_optimizer_state, "
            "single_partition_of_fp32_groups), which shardspeed's partition files do not have; "
            "shardspeed.checkpoint.CheckpointReader gives every value by parameter name at any layout"
        )
